# Every target installs into .venv first (idempotent: a stamp file records the install).
PY      := .venv/bin/python
STAMP   := .venv/.installed
# The CPU wheel of PyTorch; an unpinned torch would pull a CUDA build of several GB.
TORCH   := torch==2.13.0

.PHONY: demo test bench gpu-check lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,bench]' $(TORCH)
	touch $(STAMP)

demo: $(STAMP)
	.venv/bin/aiayn demo --out runs/demo

# A worker per core (-n auto), a test file to a worker (its module fixtures, compiled graphs included, made once).
test: $(STAMP)
	$(PY) -m pytest -q -n auto --dist loadfile

bench: $(STAMP)
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_translate.py
	$(PY) benchmarks/bench_scaling.py --plot docs/scaling.png
	$(PY) benchmarks/bench_serve.py

# On a CUDA machine: the CUDA tests, training, translation and data-pipeline benchmarks against the peers
# on the GPU, then the suite; logs and figures in runs/gpu-check
gpu-check: $(STAMP)
	PYTHON=$(PY) bash benchmarks/gpu_check.sh runs/gpu-check

lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

clean:
	rm -rf .venv runs
