"""`python -m aiayn ...` is the `aiayn` command: what `torchrun -m aiayn train ...` runs on every rank."""

import sys

from aiayn.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
