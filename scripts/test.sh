#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, lint and the formatter's check included;
# then the tests that depend on the CPU's instruction sets again, as an AVX2-only CPU (Zen 3)
# runs them: oneDNN without bf16 packing, ATen's AVX2 kernels, fbgemm without VNNI
# (tests/test_every_cpu.py), kvserve's C++ ops built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512, no VNNI), as on Zen 3. Arguments go to
# the main pytest run only, and skip the second. System packages the tests need (Chromium,
# redis-server) are installed first; a test that skips for anything but a missing GPU fails the
# run (KVSERVE_STRICT_SKIPS, tests/conftest.py), and each run ends with its skips by reason and
# its 15 slowest tests (the suite has a budget: 12 minutes for both passes on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/system_deps.sh
./scripts/setup.sh --test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export KVSERVE_STRICT_SKIPS=1
.venv/bin/python -m pytest -q --durations=15 "$@"
if [ $# -eq 0 ]; then
    echo "== ISA-dependent tests as an AVX2-only CPU runs them"
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
        KVSERVE_CPP_MARCH=x86-64-v3 exec .venv/bin/python -m pytest -q --durations=15 -m "isa and not main_pass_only"
fi
