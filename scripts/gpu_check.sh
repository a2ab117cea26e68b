#!/usr/bin/env bash
# The GPU check for a lent GPU host such as the project's H200 machines (Python 3.12, torch 2.11 +
# CUDA 13, nvcc 13.0, no network), in two back-to-back calls of the device tool. Each call
# carries at most 64 MiB with the working tree (~13 MiB), and FlashInfer's wheel alone is ~59
# MiB, so the wheels travel in two parts; the host keeps ignored paths between calls while it
# stays up, so the first call's installs and wheel part wait there for the second. Never
# installs or changes torch; kvserve's C++ CPU ops are off there (nothing on a GPU host needs
# them, and building them costs minutes).
#
#   scripts/gpu_check.sh --fetch     here (PyPI): the wheels the GPU host lacks, split into
#                                    gpu_wheels/call1 and gpu_wheels/call2; prints each call's
#                                    size with the tree
#   scripts/gpu_check.sh --call 1    on the GPU host, carry gpu_wheels/call1 (~3.5 min): facts,
#                                    the small wheels installed into .gpu_env/ (kept), the
#                                    kernel matrix, the GPU tests that need no FlashInfer
#   scripts/gpu_check.sh --call 2    then, carry gpu_wheels/call2 (~9 min): FlashInfer rebuilt
#                                    from its parts and installed, its JIT kernels compiled into
#                                    .gpu_env/ (never under $OUT, whose files are copied back),
#                                    tests/test_gpu.py, the SmolLM2 sweep (scripts/gpu_sweep.py)
#   scripts/gpu_check.sh --rehearse  here, after --fetch: both calls on this CPU in a copy of
#                                    what the device would receive, its limits checked (each
#                                    call's size, the time each call may take); GPU steps skip
#
# Output: a log per call in $OUT (when the runner sets it) or /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=${GPU_WHEELS:-gpu_wheels}  # where --fetch puts the wheels (tests: elsewhere)
ENV_DIR=.gpu_env          # kept between calls on the host: installs, FlashInfer's parts and JIT
PY=${PYTHON:-python3}
CARRY_LIMIT=$((64 * 1024 * 1024))
CALL_LIMIT_S=600          # the device tool's limit per call
CALL1_S=240               # what each call gives itself (the starts of the machine count too:
CALL2_S=540               # 15 minutes of device time in all)
FLASHINFER=flashinfer-python==0.7.2.post1
SMALL=("nvidia-ml-py==13.615.71" "apache-tvm-ffi==0.1.15.post2" "xformers==0.0.35" "gguf==0.19.0"
       "starlette==1.10.0" "uvicorn==0.54.0" "prometheus-client==0.26.0")

bytes_of() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
# what travels in every call: tracked files and untracked files git does not ignore
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null \
        | tail -1 | cut -f1
}

split_wheels() {
    # gpu_wheels/*.whl -> call1 (the small wheels and FlashInfer's first part), call2 (the rest;
    # a call over the limit is refused by the size check below)
    local room=$((CARRY_LIMIT - $(tree_bytes) - 2 * 1024 * 1024))  # 2 MiB to spare
    rm -rf "$WHEELS/call1" "$WHEELS/call2"
    mkdir -p "$WHEELS/call1" "$WHEELS/call2"
    local fi_wheel small_bytes
    fi_wheel=$(find "$WHEELS" -maxdepth 1 -name 'flashinfer_python-*.whl' | head -1)
    find "$WHEELS" -maxdepth 1 -name '*.whl' ! -name 'flashinfer_python-*' \
        -exec cp {} "$WHEELS/call1/" \;
    small_bytes=$(bytes_of "$WHEELS/call1")
    if [ -n "$fi_wheel" ]; then
        (cd "$WHEELS/call1" && sha256sum "../$(basename "$fi_wheel")" \
            | sed "s#\.\./##" > flashinfer.sha256)
        # two parts that even out the calls (the tree, which rides in both, grows)
        local wheel_bytes part
        wheel_bytes=$(bytes_of "$fi_wheel")
        part=$(((wheel_bytes - small_bytes + 1) / 2))
        [ "$part" -lt $((wheel_bytes / 8)) ] && part=$((wheel_bytes / 8))
        [ "$part" -gt $((room - small_bytes)) ] && part=$((room - small_bytes))
        head -c "$part" "$fi_wheel" > "$WHEELS/call1/$(basename "$fi_wheel").part00"
        tail -c +$((part + 1)) "$fi_wheel" > "$WHEELS/call2/$(basename "$fi_wheel").part01"
    fi
    local c
    for c in 1 2; do
        local size=$(($(bytes_of "$WHEELS/call$c") + $(tree_bytes)))
        echo "call $c carries $WHEELS/call$c: $((size / 1024 / 1024)) MiB with the tree" \
             "(limit $((CARRY_LIMIT / 1024 / 1024)))"
        if [ "$size" -gt "$CARRY_LIMIT" ]; then echo "call $c is over the limit"; return 1; fi
    done
}

if [ "${1:-}" = "--fetch" ]; then
    mkdir -p "$WHEELS"
    platforms=(--platform manylinux2014_x86_64)
    for i in $(seq 17 39); do platforms+=(--platform "manylinux_2_${i}_x86_64"); done
    .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 "${platforms[@]}" \
        -d "$WHEELS" "$FLASHINFER" "${SMALL[@]}" || exit 1
    split_wheels
    exit $?
fi
if [ "${1:-}" = "--split" ]; then  # the split alone (tests/test_gpu_check.py)
    split_wheels
    exit $?
fi

if [ "${1:-}" = "--rehearse" ]; then
    # What the device receives: the tree, then call 1's carry; later call 2's carry beside what
    # call 1 left (the host keeps ignored paths while it stays up). Each call runs under the
    # time it gives itself and the tool's limit; the GPU steps skip on this CPU.
    [ -d "$WHEELS/call1" ] || { echo "run --fetch first"; exit 1; }
    device=$(mktemp -d)
    venv_python=${PYTHON:-$PWD/.venv/bin/python}
    git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$device"
    status=0
    for c in 1 2; do
        size=$(($(bytes_of "$WHEELS/call$c") + $(tree_bytes)))
        mkdir -p "$device/$WHEELS" && cp -r "$WHEELS/call$c" "$device/$WHEELS/"
        start=$(date +%s)
        (cd "$device" && OUT="$device/out$c" PYTHON="$venv_python" \
            timeout "$CALL_LIMIT_S" bash scripts/gpu_check.sh --call "$c" --rehearsal)
        rc=$?
        took=$(($(date +%s) - start))
        echo "rehearsed call $c: exit $rc, $took s (gives itself $([ "$c" = 1 ] && echo \
            "$CALL1_S" || echo "$CALL2_S") s, limit $CALL_LIMIT_S s), $((size / 1024 / 1024)) MiB"
        [ "$rc" -eq 0 ] && [ "$size" -le "$CARRY_LIMIT" ] || status=1
        [ -z "$(find "$device/out$c" -path '*flashinfer*' -print -quit)" ] \
            || { echo "FlashInfer's cache would be copied back"; status=1; }
    done
    rm -rf "$device"
    exit $status
fi

[ "${1:-}" = "--call" ] && [ -n "${2:-}" ] || { echo "usage: see the header"; exit 2; }
CALL=$2
REHEARSAL=$([ "${3:-}" = "--rehearsal" ] && echo 1 || echo 0)
OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR" "$ENV_DIR/site" "$ENV_DIR/wheels"
exec > >(tee "$OUT_DIR/gpu_check_call$CALL.log") 2>&1
START=$(date +%s)
BUDGET=$([ "$CALL" = 1 ] && echo "$CALL1_S" || echo "$CALL2_S")
elapsed() { echo "[$(($(date +%s) - START))s] $*"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
# a step gets what is left of the call's budget, at most $1 seconds
step() { local most=$1; shift; local t; t=$(left); [ "$t" -gt "$most" ] && t=$most
         [ "$t" -gt 5 ] || { echo "no time left for: $*"; return 124; }; timeout "$t" "$@"; }

export PYTHONPATH=$PWD/$ENV_DIR/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=$PWD/$ENV_DIR  # JIT kernels kept, and not copied back
export KVSERVE_NO_CPP=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
has_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
pip_target=(-m pip install -q --no-index --no-deps --upgrade --target "$ENV_DIR/site")
[ "$REHEARSAL" = 1 ] && pip_target+=(--python-version 3.12 --only-binary=:all:)
status=0

if [ "$CALL" = 1 ]; then
    elapsed "environment"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    (nvcc --version | tail -2) || echo "nvcc: not found (FlashInfer's JIT needs it)"
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda)"
    elapsed "installing $(find "$WHEELS/call1" -name '*.whl' | wc -l) small wheels into $ENV_DIR"
    step 60 "$PY" "${pip_target[@]}" "$WHEELS"/call1/*.whl || status=1
    cp "$WHEELS"/call1/*.part* "$WHEELS/call1/flashinfer.sha256" "$ENV_DIR/wheels/" 2>/dev/null
    if [ "$has_gpu" = 1 ]; then
        elapsed "kernel matrix without FlashInfer (python -m server kernels)"
        step 60 "$PY" -m server kernels --device cuda --dtype bfloat16 || true
        elapsed "GPU tests that need no FlashInfer"
        step 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs -k "not flashinfer \
and not graphs" || status=1
    else
        elapsed "no GPU here: the kernel matrix and GPU tests skip"
    fi
else
    elapsed "rebuilding FlashInfer's wheel from its parts"
    cp "$WHEELS"/call2/*.part* "$ENV_DIR/wheels/" 2>/dev/null
    first=$(find "$ENV_DIR/wheels" -name '*.part00' | head -1)
    wheel=$ENV_DIR/wheels/$(basename "${first%.part00}")
    if [ -z "$first" ]; then echo "call 1 left no FlashInfer part here"; exit 1; fi
    cat "${first%.part00}".part* > "$wheel"
    (cd "$ENV_DIR/wheels" && sha256sum -c flashinfer.sha256) || exit 1
    elapsed "installing $(basename "$wheel")"
    step 90 "$PY" "${pip_target[@]}" "$wheel" || status=1
    if [ "$has_gpu" = 1 ]; then
        elapsed "FlashInfer's JIT kernels (first use compiles them; kept in $ENV_DIR)"
        step 330 "$PY" -m server kernels --device cuda --dtype bfloat16 || true
        step 330 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -rs \
            -k "flashinfer or graphs or warm_up" || status=1
        elapsed "SmolLM2 sweep"
        step 150 "$PY" scripts/gpu_sweep.py --concurrency 1,16,64 --max-tokens 128 || status=1
    else
        "$PY" -c "import sys; sys.path.insert(0, '$ENV_DIR/site'); \
import importlib.metadata as m; print('installed: flashinfer-python', m.version('flashinfer-python'))" \
            || status=1
        elapsed "no GPU here: FlashInfer's JIT, the GPU tests and the sweep skip"
    fi
fi
elapsed "call $CALL done (exit $status; budget $BUDGET s)"
exit $status
