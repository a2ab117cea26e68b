#!/usr/bin/env bash
# Set up (idempotent) and serve the default model, SmolLM2-135M-Instruct, on port 8000.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m server "$@"
