#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, lint included; then the tests that depend on
# the CPU's instruction sets again, as an AVX2-only CPU (Zen 3) runs them: oneDNN without bf16
# packing, ATen's AVX2 kernels, fbgemm without VNNI (tests/test_every_cpu.py). Arguments go to
# the first pytest run only, and skip the second.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
if [ $# -eq 0 ]; then
    echo "== ISA-dependent tests under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2"
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        exec .venv/bin/python -m pytest -q -m isa
fi
