#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite, lint included.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
