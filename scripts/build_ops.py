"""Build kvserve's C++ ops ahead of their first use, all at once: one process per op and -march
(`KVSERVE_CPP_MARCH`), as many at a time as there are cores. Each takes ~15 s of g++ alone, and
at first use they would build one after another inside whatever started first (a server's
startup, a test). An op that cannot build here is reported and left to its PyTorch fallback.

    .venv/bin/python scripts/build_ops.py [MARCH ...]     # default: native

The venv's editable install makes `models` and `engine` importable (no sys.path edit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the modules that own a `CppOps` (models/cpp_ext.py), as "module:attribute"
MODULES = ("models.cpu_fused:_OPS", "models.gguf_linear:_OPS", "models.gguf_linear:_Q8_OPS",
           "engine.attention.cpu_decode:_OPS", "engine.grammar.token_bitmask:_OPS",
           "models.decode_stack:_OPS", "engine.attention.cpu_prefill:_OPS",
           "models.int8_prefill:_OPS")  # fmt: skip


def build(entry: str, march: str) -> str:
    module, attr = entry.split(":")
    env = {**os.environ, "KVSERVE_CPP_MARCH": march}
    code = f"import sys, {module} as m; sys.exit(0 if m.{attr}.load() is not None else 1)"
    t = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    took = f"{time.monotonic() - t:.0f} s"
    if done.returncode == 0:
        return f"{entry} ({march}): ok, {took}"
    return f"{entry} ({march}): not built, PyTorch fallback ({done.stderr.strip()[-200:]})"


def built(entry: str, march: str) -> bool:
    """Whether the op's library for its current sources is complete on disk."""
    import importlib

    os.environ["KVSERVE_CPP_MARCH"] = march  # read by build_dir()
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr).is_built()


def main() -> None:
    marches = sys.argv[1:] or ["native"]
    jobs = [(m, a) for a in marches for m in MODULES if not built(m, a)]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for line in pool.map(lambda job: build(*job), jobs):
            print(f"C++ ops: {line}", flush=True)


if __name__ == "__main__":
    main()
