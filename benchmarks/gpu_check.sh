#!/usr/bin/env bash
# The GPU checks in one command, on any CUDA machine: the CUDA tests, the training, translation and
# data-pipeline benchmarks against the peers, then the whole suite. Each part's log goes to DIR (a
# benchmark's last line is its JSON); a part that fails or runs out of time is reported and the next one still runs.
#
#   bash benchmarks/gpu_check.sh [DIR]          (make gpu-check: DIR = runs/gpu-check)
#   PARTS="cuda-tests train" bash benchmarks/gpu_check.sh      only those parts
#   DEADLINE_S=540 ...                          stop starting parts after this many seconds
#   TRAIN_ARGS, TRANSLATE_ARGS, PIPELINE_ARGS   more flags for that benchmark (e.g. TRANSLATE_ARGS="--dtypes bf16")
# PYTHON picks the interpreter (default: .venv/bin/python if there is one, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-runs/gpu-check}
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
PARTS=${PARTS:-cuda-tests train translate pipeline suite}
DEADLINE_S=${DEADLINE_S:-3600}
export PYTHONUNBUFFERED=1
mkdir -p "$DIR"
start=$(date +%s)
failed=()

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: CUDA is not available to $PY" >&2
    exit 2
fi
{ nvidia-smi; "$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name())'; } \
    > "$DIR/machine.txt" 2>&1
head -n 20 "$DIR/machine.txt"

# part NAME LIMIT_S COMMAND...: runs COMMAND into DIR/NAME.log within LIMIT_S and the deadline
part() {
    local name=$1 limit=$2
    shift 2
    [[ " $PARTS " == *" $name "* ]] || return 0
    local left=$((DEADLINE_S - ($(date +%s) - start)))
    if ((left < 30)); then
        echo "== $name: not started, the deadline is $left s away"
        failed+=("$name(not started)")
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most $limit s): $*"
    local t0=$(date +%s)
    timeout --signal=INT --kill-after=15 "$limit" "$@" > "$DIR/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $(($(date +%s) - t0)) s"
    tail -n 4 "$DIR/$name.log"
    ((rc == 0)) || failed+=("$name(exit $rc)")
}

part cuda-tests 300 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py
part train 240 "$PY" benchmarks/bench_train.py --device cuda --profile ${TRAIN_ARGS:-}
part translate 300 "$PY" benchmarks/bench_translate.py --device cuda ${TRANSLATE_ARGS:-}
work=$(mktemp -d)  # the pipeline's corpus and run, a few hundred MB
part pipeline 240 "$PY" benchmarks/bench_pipeline.py --work "$work" ${PIPELINE_ARGS:-}
part suite 600 "$PY" -m pytest -q -p no:cacheprovider -n 8 --dist loadfile --ignore=tests/test_cuda.py
rm -rf "$work"

echo "gpu_check: $(($(date +%s) - start)) s; failed: ${failed[*]:-none}"
((${#failed[@]} == 0))
