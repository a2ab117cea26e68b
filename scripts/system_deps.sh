#!/usr/bin/env bash
# The system packages the tests need, from Debian's archive: Chromium (the browser test of the
# built-in page) and redis-server (the KV block store of the disaggregation tests). Installed
# once; a machine that has both skips apt entirely.
set -euo pipefail
if command -v chromium >/dev/null 2>&1 && command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/system_deps.sh: no apt-get here; install chromium and redis-server yourself" >&2
    exit 1
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium redis-server
