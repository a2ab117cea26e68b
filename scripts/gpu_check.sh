#!/usr/bin/env bash
# shellcheck disable=SC2329  # the step_* functions run, exported, through `bash -c`
# The GPU check for a lent GPU host such as the project's H200 machines (Python 3.12, torch 2.11 +
# CUDA 13, nvcc 13.0, no network): ONE call of the device tool, self-contained, so a fresh
# machine can run it again. What the host lacks travels in one archive beside the tree (the
# device carries at most 64 MiB a call): the packages installed here for Python 3.12 with pip
# --target, without their declared dependencies (the image's set: Dockerfile), and FlashInfer
# trimmed to what this project JIT-compiles. Never installs or changes torch; kvserve's C++ CPU
# ops are off there (nothing on a GPU host needs them).
#
#   scripts/gpu_check.sh --fetch     here (PyPI): gpu_wheels/site.tar.gz; prints the carry
#   scripts/gpu_check.sh --plan      the steps, each one's bound, and their total
#   scripts/gpu_check.sh --run       on the GPU host, carry gpu_wheels: the steps below in order,
#                                    each under its bound and what is left of the call's budget;
#                                    a step the budget cuts or the host cannot run is reported
#                                    as not run, never as passed
#   scripts/gpu_check.sh --rehearse  here, after --fetch: --run on this CPU in a copy of exactly
#                                    what the device receives, the carry and the budget checked,
#                                    importing only what the host's image has plus the archive
#   scripts/gpu_check.sh --check-trim here, after --fetch (needs nvcc, not a GPU): every source
#                                    of the FlashInfer JIT modules this project builds scanned
#                                    for its headers against the carried, trimmed FlashInfer
#
# Output: the log and a step table (gpu_check.tsv) in $OUT (when the runner sets it) or
# /tmp/gpu_check. FlashInfer's JIT cache goes to .gpu_env/ (kept while the machine stays warm,
# never under $OUT, whose files are copied back).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=${GPU_WHEELS:-gpu_wheels}
ENV_DIR=.gpu_env
PY=${PYTHON:-python3}
SITE_PYTHON=3.12          # the host's Python, which the carried packages are built for
CARRY_LIMIT=$((64 * 1024 * 1024))
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}  # the call's own budget: 8 minutes (the tool's limit is 10)
FLASHINFER=$(sed -n 's/^gpu-without-deps = \["\(.*\)"\]$/\1/p' pyproject.toml)  # as the image
# the image's GPU set beside FlashInfer (pyproject's `gpu` extra), and what the server needs
# that the host's image lacks (its package list: /work/.library/device/KINDS.md)
PACKAGES=("$FLASHINFER" "apache-tvm-ffi==0.1.15.post2" "xformers==0.0.35" "gguf==0.19.0"
          "starlette==1.10.0" "uvicorn==0.54.0" "pydantic==2.14.4" "pydantic-core==2.50.5"
          "annotated-types==0.7.0" "typing-inspection==0.4.5" "xgrammar==0.2.9")
# FlashInfer's sources and headers, kept by an allowlist: its JIT builds this project's
# attention (batch decode and prefill, fa2 and fa3) and the paged-KV append from the top-level
# files of data/csrc, with the include directories jit/env.py names; every csrc subtree (MoE,
# GEMM, communication, other models' ops, trtllm's fmha_v2), CUTLASS's and CCCL's examples,
# tests, tools and docs stay behind; of the experimental kernels, only the package that
# `import flashinfer` loads (gemm_base imports a requirement from it)
KEEP_DATA=(include cutlass/include cutlass/tools/util/include cccl/cub cccl/libcudacxx/include
           cccl/thrust spdlog/include)
KEEP_EXPERIMENTAL=(cake_nvfp4_per_token)
trim_flashinfer() {  # $1: the staged site directory
    local data=$1/flashinfer/data kept d
    kept=$(mktemp -d) || return 1
    for d in "${KEEP_DATA[@]}"; do
        [ ! -e "$data/$d" ] || (cd "$data" && cp -r --parents "$d" "$kept/") || return 1
    done
    mkdir "$kept/csrc" && find "$data/csrc" -maxdepth 1 -type f -exec cp -t "$kept/csrc" {} + \
        || return 1
    find "$data" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
    cp -r "$kept"/. "$data/" && rm -rf "$kept" || return 1
    local experimental=$1/flashinfer/experimental keep=() name
    for name in "${KEEP_EXPERIMENTAL[@]}"; do keep+=(-not -name "$name"); done
    find "$experimental" -mindepth 1 -maxdepth 1 -type d "${keep[@]}" -exec rm -rf {} +
}

# name | bound (s) | needs a GPU | command. The cheapest, most informative first. Each bound is
# the step's CPU-side cost measured on a 2-core dev machine (scripts/gpu_step_costs.py) plus
# what the GPU adds, with room:
#   unpack: the archive (~40 MB) and `import server.app` (2.9 s here)
#   model: the head-64 checkpoint (4.3 s); kernels: load + matrix (4.0 s on the CPU) + CUDA init
#   torch: 9 CUDA engine builds (load, CUDA graphs; the first also inits CUDA and compiles
#     xformers' Triton kernel, ~30 s) + 1 CPU engine (5.8 s); the warm-up test runs in the
#     flashinfer step only
#   flashinfer-compile: one fa3 unit compiled in 59 s on one core here (--time-one-unit); the
#     prebuild runs the ~12 units of page, decode and fa3 prefill at once on the host's cores
#   sweep: the 135M random checkpoint (6.8 s) + two engines (graphs on, off) + 3 x 2 runs
STEPS=(
    "facts|10|0|step_facts"
    "unpack|20|0|step_unpack"
    "model|15|0|step_model"
    "kernels|20|1|$PY -m server kernels --model \$MODEL --device cuda --dtype bfloat16"
    "torch|100|1|$PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs -k 'not flashinfer and not graphs and not xformers and not warm_up'"
    "flashinfer-compile|150|1|step_compile"
    "flashinfer|45|1|$PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs -k 'flashinfer or xformers or warm_up'"
    "graphs|35|1|$PY -m pytest -q -p no:cacheprovider tests/test_gpu.py -rs -k graphs"
    "http|45|1|$PY scripts/gpu_http_check.py \$MODEL --device cuda --timeout 40"
    "sweep|40|1|$PY scripts/gpu_sweep.py --concurrency 1,16,64 --max-tokens 64"
)

bytes_of() { du -sb "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
# what travels in every call: tracked files and untracked files git does not ignore
tree_bytes() {
    git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null \
        | tail -1 | cut -f1
}
carry_report() {
    local size=$(($(bytes_of "$WHEELS/site.tar.gz") + $(tree_bytes)))
    echo "the call carries $((size / 1024 / 1024)) MiB: the tree and $WHEELS/site.tar.gz" \
         "($(($(bytes_of "$WHEELS/site.tar.gz") / 1024 / 1024)) MiB; limit" \
         "$((CARRY_LIMIT / 1024 / 1024)))"
    [ "$size" -le "$CARRY_LIMIT" ] || { echo "over the limit"; return 1; }
}
plan() {
    local total=0 s
    for s in "${STEPS[@]}"; do
        IFS='|' read -r name bound gpu cmd <<< "$s"
        printf '%-20s %4s s  %-5s %s\n' "$name" "$bound" "$([ "$gpu" = 1 ] && echo GPU)" "$cmd"
        total=$((total + bound))
    done
    echo "total $total s of a $BUDGET_S s budget"
    [ "$total" -le "$BUDGET_S" ]
}

case "${1:-}" in
--fetch)
    stage=$(mktemp -d)
    platforms=(--platform manylinux2014_x86_64)
    for i in $(seq 17 39); do platforms+=(--platform "manylinux_2_${i}_x86_64"); done
    mkdir -p "$WHEELS"
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version "$SITE_PYTHON" \
        --implementation cp "${platforms[@]}" -d "$stage/wheels" "${PACKAGES[@]}" || exit 1
    .venv/bin/pip install -q --no-deps --no-compile --only-binary=:all: \
        --python-version "$SITE_PYTHON" \
        --implementation cp "${platforms[@]}" --target "$stage/site" "$stage"/wheels/*.whl \
        || exit 1
    trim_flashinfer "$stage/site" || exit 1
    find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
    tar -C "$stage/site" -czf "$WHEELS/site.tar.gz" .
    rm -rf "$stage"
    carry_report
    exit $?
    ;;
--plan)
    plan
    exit $?
    ;;
--check-trim)
    [ -f "$WHEELS/site.tar.gz" ] || { echo "run --fetch first"; exit 1; }
    export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
    command -v nvcc > /dev/null || [ -x "$CUDA_HOME/bin/nvcc" ] || { echo "no nvcc here"; exit 1; }
    site=$(mktemp -d)
    mkdir "$site/fi" && tar -C "$site/fi" -xzf "$WHEELS/site.tar.gz" ./flashinfer || exit 1
    extra=()
    if [ ! -f "$CUDA_HOME/include/curand_kernel.h" ]; then  # a partial toolkit: curand's headers
        headers=$WHEELS/cuda_headers
        if [ ! -f "$headers/nvidia/cu13/include/curand_kernel.h" ]; then
            .venv/bin/pip download -q --no-deps nvidia-curand -d "$site/whl" || exit 1
            mkdir -p "$headers" && unzip -q -o "$site"/whl/*.whl 'nvidia/cu13/include/*' -d "$headers"
        fi
        extra=(--cuda-include "$headers/nvidia/cu13/include")
    fi
    PYTHONPATH=$site/fi:$PWD .venv/bin/python scripts/flashinfer_sources.py "${extra[@]}"
    rc=$?
    rm -rf "$site"
    exit $rc
    ;;
--rehearse)
    [ -f "$WHEELS/site.tar.gz" ] || { echo "run --fetch first"; exit 1; }
    device=$(mktemp -d)
    git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$device"
    mkdir -p "$device/$WHEELS" && cp "$WHEELS/site.tar.gz" "$device/$WHEELS/"
    status=0
    carry_report || status=1
    plan > /dev/null || { echo "the steps' bounds exceed the budget"; status=1; }
    start=$(date +%s)
    here_python=${PYTHON:-$PWD/.venv/bin/python}
    # the host's package set, imitated: the server may import only what the host's image has
    # and the archive carries (scripts/gpu_host/sitecustomize.py), whatever this venv holds
    (cd "$device" && OUT="$device/out" GPU_CHECK_REHEARSAL=1 PYTHON="$here_python" \
        GPU_WHEELS="$WHEELS" KVSERVE_HOST_PACKAGES="$device/scripts/gpu_host/packages.txt" \
        KVSERVE_CARRIED_PACKAGES="${PACKAGES[*]%%==*}" PYTHONPATH="$device/scripts/gpu_host" \
        timeout 600 bash scripts/gpu_check.sh --run)
    rc=$?
    echo "rehearsed: exit $rc, $(($(date +%s) - start)) s (budget $BUDGET_S s, limit 600 s)"
    [ "$rc" -eq 0 ] || status=1
    [ -z "$(find "$device/out" -path '*flashinfer*' -print -quit)" ] \
        || { echo "FlashInfer's cache would be copied back"; status=1; }
    cp "$device/out/gpu_check.tsv" "${REHEARSAL_TSV:-/dev/null}" 2>/dev/null
    rm -rf "$device"
    exit $status
    ;;
--run) ;;
*) echo "usage: see the header"; exit 2 ;;
esac

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR" "$ENV_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
START=$(date +%s)
if [ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$SITE_PYTHON" ]; then
    SITE_PATH=$PWD/$ENV_DIR/site
else  # a rehearsal on another Python: the carried FlashInfer (pure Python, the trimmed one)
    SITE_PATH=$PWD/$ENV_DIR/flashinfer_only  # over this venv's compiled packages
fi
export PYTHONPATH=$SITE_PATH:$PWD${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_WORKSPACE_BASE=$PWD/$ENV_DIR  # JIT kernels kept, and not copied back
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}  # the H200's only
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export KVSERVE_NO_CPP=1
# FlashInfer finds the toolkit from CUDA_HOME, else the nvcc on PATH; CUTLASS's utilities
# include curand's headers, which a toolkit may lack where the pip package nvidia-curand has them
toolkit=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /x/x/x)")")")}
if [ ! -f "$toolkit/include/curand_kernel.h" ]; then
    curand=$("$PY" -c "import importlib.util as u, pathlib; print(next((str(p) for d in \
u.find_spec('nvidia').submodule_search_locations for p in pathlib.Path(d).glob('*/include') \
if (p / 'curand_kernel.h').exists()), ''))" 2>/dev/null)
    [ -z "$curand" ] || export FLASHINFER_EXTRA_CUDAFLAGS="-isystem $curand"
fi
export MODEL=$PWD/$ENV_DIR/model
has_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step_facts() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    (nvcc --version | tail -2) || echo "nvcc: not found (FlashInfer's JIT needs it)"
    echo "toolkit: ${toolkit}; extra CUDA flags: ${FLASHINFER_EXTRA_CUDAFLAGS:-none}"
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| GPU', torch.cuda.is_available())"
}
step_unpack() {
    # fresh every call: what a previous call left must not stand in for this carry
    rm -rf "$ENV_DIR/site" "$ENV_DIR/flashinfer_only" && mkdir -p "$ENV_DIR/site" \
        && tar -C "$ENV_DIR/site" -xzf "$WHEELS/site.tar.gz" \
        && mkdir "$ENV_DIR/flashinfer_only" && ln -s ../site/flashinfer "$ENV_DIR/flashinfer_only/" \
        && "$PY" -c "import importlib.metadata as m, flashinfer, flashinfer.decode, \
flashinfer.prefill, flashinfer.page, starlette, pydantic, gguf, xgrammar, server.app; \
print('flashinfer from', flashinfer.__file__); print(*(f'{d} {m.version(d)}' for d in \
('flashinfer-python', 'xformers', 'starlette', 'pydantic', 'xgrammar')), sep=' | ')"
}
step_model() {
    # a real model directory (the default model's wheel is not on the host): the GPU tests'
    # head-64 GQA-2 Llama, whose kernels the compile step builds for them
    "$PY" -c "from pathlib import Path; from tests.conftest import HEAD64_GQA2, build_model; \
build_model('llama', Path('$MODEL'), **HEAD64_GQA2)" && ls "$MODEL"
}
step_compile() {
    # FlashInfer's JIT alone, timed: first the modules a bfloat16 head-64 warm-up loads, all
    # their nvcc units in one parallel ninja run (FlashInfer's own JIT builds module after
    # module: fa3 prefill's units, then decode's); then an LLM's warm-up plans and runs prefill
    # and decode, loading them (and compiling, one by one, anything the prebuild missed)
    "$PY" scripts/flashinfer_sources.py --prebuild --head-dims 64 \
        || echo "parallel prebuild failed: the warm-up compiles module by module"
    "$PY" -c "import time; t = time.time(); from engine import LLM; \
llm = LLM('$MODEL', device='cuda', attention_backend='flashinfer', num_kv_blocks=64); \
print('FlashInfer warm-up (JIT compile) %.0f s' % (time.time() - t))"
}

export -f step_facts step_unpack step_model step_compile
export PY ENV_DIR WHEELS toolkit
printf 'step\tbound_s\ttook_s\tresult\n' > "$OUT_DIR/gpu_check.tsv"
status=0
# on the device a missing GPU fails the check; the rehearsal on a CPU expects it
[ "$has_gpu" = 1 ] || [ "${GPU_CHECK_REHEARSAL:-0}" = 1 ] || { echo "no GPU here"; status=1; }
for s in "${STEPS[@]}"; do
    IFS='|' read -r name bound gpu cmd <<< "$s"
    left=$((BUDGET_S - ($(date +%s) - START)))
    t=$((bound < left ? bound : left))
    echo "== [$(($(date +%s) - START))s] $name (bound $bound s)"
    if [ "$gpu" = 1 ] && [ "$has_gpu" != 1 ]; then
        result="not run: no GPU"
    elif [ "$t" -lt 5 ]; then
        result="not run: budget spent"; status=1
    else
        step_start=$(date +%s)
        timeout "$t" bash -c "$cmd"
        rc=$?
        took=$(($(date +%s) - step_start))
        if [ "$rc" -eq 0 ]; then result="passed"
        elif [ "$rc" -eq 124 ]; then result="timed out after $t s"; status=1
        else result="failed (exit $rc)"; status=1
        fi
    fi
    printf '%s\t%s\t%s\t%s\n' "$name" "$bound" "${took:-0}" "$result" >> "$OUT_DIR/gpu_check.tsv"
    unset took
    echo "-- $name: $result"
done
echo "== [$(($(date +%s) - START))s] done (exit $status; budget $BUDGET_S s)"
column -t -s $'\t' "$OUT_DIR/gpu_check.tsv" 2>/dev/null || cat "$OUT_DIR/gpu_check.tsv"
exit $status
