#!/bin/sh
# Container entrypoint: every argument goes to kvserve (`kernels --model PATH` prints the kernel
# matrix instead of serving); configuration also comes from KVSERVE_* environment variables
# (host, port, API key, ...). exec so SIGTERM reaches the server, which drains in-flight
# requests before exiting.
set -e
exec kvserve "$@"
