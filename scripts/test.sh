#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, lint and the formatter's check included.
# The tests that wait on PyPI (marker `network`) run beside the main pass. Then the tests that
# depend on the CPU's instruction sets run again as an AVX2-only CPU (Zen 3) runs them: oneDNN
# without bf16 packing, ATen's AVX2 kernels, fbgemm without VNNI (tests/test_every_cpu.py),
# kvserve's C++ ops built for x86-64-v3 (AVX2, FMA, F16C; no AVX-512, no VNNI). Arguments make
# one pytest run of just what they select. System packages the tests need (Chromium,
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
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest -q --durations=15 "$@"
fi
# the tests that wait on PyPI run beside the main pass: they hardly use the CPU it needs
network_log=$(mktemp)
network_files=$(grep -l "pytest.mark.network" tests/test_*.py)  # collect only those files
# shellcheck disable=SC2086
.venv/bin/python -m pytest -q -p no:cacheprovider -m network $network_files >"$network_log" 2>&1 &
network=$!
main_rc=0
.venv/bin/python -m pytest -q --durations=15 -m "not network" || main_rc=$?
network_rc=0
wait "$network" || network_rc=$?
echo "== the tests that wait on PyPI (run beside the main pass)"
cat "$network_log"
rm -f "$network_log"
[ "$main_rc" -eq 0 ] && [ "$network_rc" -eq 0 ] || exit 1
echo "== ISA-dependent tests as an AVX2-only CPU runs them"
isa_files=$(grep -l "mark.isa" tests/test_*.py)  # collect only the modules that have them
# shellcheck disable=SC2086
ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 \
    KVSERVE_CPP_MARCH=x86-64-v3 exec .venv/bin/python -m pytest -q --durations=15 \
    -m "isa and not main_pass_only" $isa_files
