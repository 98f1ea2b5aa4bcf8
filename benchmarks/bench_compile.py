"""What compiling the decoding step costs a fresh process, with an empty and with a filled cache.

Each figure is one new process (the CLI's situation): build the model, translate one sentence (the
first call: tracing and compiling, or loading, included), then translate it again (warm). Eager is the
reference. Compiled two ways, each twice on one cache directory, first empty (a cold start), then
filled by the first (a second `aiayn translate --compile`): in memory (torch.compile; its cache is
inductor's, TORCHINDUCTOR_CACHE_DIR), and to a store of AOTInductor packages (CompiledDecoder(store=...),
what `--compile` does), which a second process loads instead of tracing again.
Workload of bench_translate.py: random weights, 24 new tokens.

    python benchmarks/bench_compile.py [--configs small,base] [--beams 1,4] [--batch 1]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(config: str, beam: int, batch: int, compile: bool, store: str | None) -> None:
    """In the measured process: print one JSON line of seconds."""
    start = time.perf_counter()
    sys.path.insert(0, str(HERE))
    import torch
    from bench_train import aiayn_model
    from common import CONFIGS, NoEos, pad, random_sentences, set_threads

    from aiayn.config import SearchConfig
    from aiayn.inference.compiled import CompiledDecoder
    from aiayn.inference.search import search
    from aiayn.precision import for_inference

    set_threads()
    shape = CONFIGS[config]
    torch.manual_seed(0)
    model = for_inference(aiayn_model(shape), "fp32")
    decoder = NoEos(CompiledDecoder(model, store=store) if compile else model)
    src = pad(random_sentences(batch, shape["vocab"], seed=4321))
    ready = time.perf_counter()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        search(decoder, src, SearchConfig(beam_size=beam), max_len=24)
        times.append(time.perf_counter() - t)
    print(json.dumps({"import_and_build_s": ready - start, "first_s": times[0], "warm_s": min(times[1:])}))


def measure(config: str, beam: int, batch: int, compile: bool, cache: str, store: str = "-") -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    argv = [sys.executable, __file__, "--child", config, str(beam), str(batch), str(int(compile)), store]
    start = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return {**json.loads(out.splitlines()[-1]), "process_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="small,base")
    ap.add_argument("--beams", default="1,4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        config, beam, batch, compile, store = args.child
        return child(config, int(beam), int(batch), bool(int(compile)), None if store == "-" else store)
    sys.path.insert(0, str(HERE))
    from common import machine

    print(f"machine: {machine()}")
    rows = []
    for config in args.configs.split(","):
        for beam in (int(b) for b in args.beams.split(",")):
            with (
                tempfile.TemporaryDirectory(prefix="aiayn-inductor-") as cache,
                tempfile.TemporaryDirectory(prefix="aiayn-inductor-") as store_cache,
                tempfile.TemporaryDirectory(prefix="aiayn-store-") as store,
            ):
                cells = {
                    "eager": measure(config, beam, args.batch, False, cache),
                    "in memory, empty cache": measure(config, beam, args.batch, True, cache),
                    "in memory, cached": measure(config, beam, args.batch, True, cache),
                    "store, empty": measure(config, beam, args.batch, True, store_cache, store),
                    "store, filled": measure(config, beam, args.batch, True, store_cache, store),
                }
                megabytes = sum(f.stat().st_size for f in Path(store).glob("*.pt2")) / 1e6
                cells["store, filled"]["store_mb"] = megabytes  # the packages of this workload's graphs
            for name, cell in cells.items():
                rows.append({"config": config, "beam": beam, "batch": args.batch, "system": name, **cell})
                print(
                    f"{config:6} beam{beam} bs{args.batch} {name:22} first {cell['first_s']:7.2f} s  warm "
                    f"{cell['warm_s']:6.3f} s  process {cell['process_s']:6.1f} s"
                    + (f"  store {cell['store_mb']:.0f} MB" if "store_mb" in cell else "")
                )
    print(json.dumps({"benchmark": "compile", "machine": machine(), "results": rows}))


if __name__ == "__main__":
    main()
