# Every target first installs into .venv what it uses, and no more: the demo the core and plots (its
# figures), the tests dev (every extra and the test tools), the benchmarks bench. Idempotent: a stamp
# file per set of extras records its install.
PY      := .venv/bin/python
# The CPU wheel of PyTorch; an unpinned torch would pull a CUDA build of several GB.
TORCH   := torch==2.13.0

.PHONY: demo test bench gpu-check lint clean

# uv resolves and installs what pip does (the same versions) in seconds instead of a minute and a half,
# which is a third of the suite's time on 2 cores. It does not read pip's configuration, so the machine's
# own wheel folders and indexes (`pip config`: a local PyTorch CPU wheel, say) are handed to it; where uv
# cannot install, pip does. No bytecode is compiled at install (all of it: 17 s of the suite's time on
# 2 cores): the targets run Python with bytecode writing on, even where PYTHONDONTWRITEBYTECODE is set,
# so that the modules a process imports are compiled once, by the first, instead of by every process.
PYRUN   := env -u PYTHONDONTWRITEBYTECODE
PIP_FIND_LINKS_CONFIG := $(shell python3 -m pip config get global.find-links 2>/dev/null)
PIP_INDEXES_CONFIG := $(shell python3 -m pip config get global.extra-index-url 2>/dev/null)
UV_SOURCES := --index-strategy unsafe-best-match $(foreach l,$(PIP_FIND_LINKS_CONFIG),--find-links $(l)) \
	$(foreach i,$(PIP_INDEXES_CONFIG),--extra-index-url $(i))

.venv/.installed-%: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	($(PY) -m pip install -q uv && .venv/bin/uv pip install -q --python $(PY) $(UV_SOURCES) -e '.[$*]' $(TORCH)) \
		|| ($(PY) -m pip install -q $(TORCH) && $(PY) -m pip install -q -e '.[$*]' $(TORCH))
	touch $@

demo: .venv/.installed-plots
	$(PYRUN) .venv/bin/aiayn demo --out runs/demo

# A worker per core (-n auto), a test file to a worker (its module fixtures, compiled graphs included, made
# once), the files in the order tests/conftest.py gives them (xdist would reorder them by their number of
# tests, which sends the longest files, a few slow tests each, last: one worker ran on alone for minutes).
test: .venv/.installed-dev
	$(PYRUN) $(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

bench: .venv/.installed-bench
	$(PY) benchmarks/bench_train.py
	$(PY) benchmarks/bench_translate.py
	$(PY) benchmarks/bench_real.py
	$(PY) benchmarks/bench_scaling.py --plot docs/scaling.png
	$(PY) benchmarks/bench_serve.py
	$(PY) benchmarks/bench_text.py

# On a CUDA machine: the CUDA tests, training, translation and data-pipeline benchmarks against the peers
# on the GPU, then the suite; logs and figures in runs/gpu-check
gpu-check: .venv/.installed-dev .venv/.installed-bench
	PYTHON=$(PY) bash benchmarks/gpu_check.sh runs/gpu-check

lint: .venv/.installed-dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

clean:
	rm -rf .venv runs
