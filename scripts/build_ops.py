"""Build kvserve's C++ ops ahead of their first use, all at once: one process per op and -march
(`KVSERVE_CPP_MARCH`), as many at a time as there are cores. Each takes ~15 s of g++ alone, and
at first use they would build one after another inside whatever started first (a server's
startup, a test). An op that cannot build here is reported and left to its PyTorch fallback.

    .venv/bin/python scripts/build_ops.py [MARCH ...]     # default: native
    python scripts/build_ops.py --prebuilt --strict x86-64-v3 x86-64-v4 x86-64-v4-bf16  # an image's

--prebuilt writes into the install's prebuilt directory (models/cpp_ext.py `prebuilt_dir()`, under
the environment's prefix) instead of TORCH_EXTENSIONS_DIR: a later start without a compiler loads
the best portable level there that its CPU runs. --strict fails (exit 1) if any op did not build,
so an image never ships without the ops it promises. --only MODULE:ATTR limits the ops built.

The ops are imported from wherever this interpreter finds `models` and `engine` (the venv's
editable install, or an installed wheel): the build directory is named by the sources' content,
so either copy of the same sources builds the same thing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# the modules that own a `CppOps` (models/cpp_ext.py), as "module:attribute"
MODULES = ("models.cpu_fused:_OPS", "models.gguf_linear:_OPS", "models.gguf_linear:_Q8_OPS",
           "engine.attention.cpu_decode:_OPS", "engine.grammar.token_bitmask:_OPS",
           "models.decode_stack:_OPS", "engine.attention.cpu_prefill:_OPS",
           "models.int8_prefill:_OPS")  # fmt: skip


def build(entry: str, march: str) -> tuple[bool, str]:
    module, attr = entry.split(":")
    env = {**os.environ, "KVSERVE_CPP_MARCH": march}
    code = f"import sys, {module} as m; sys.exit(0 if m.{attr}.load() is not None else 1)"
    t = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    took = f"{time.monotonic() - t:.0f} s"
    if done.returncode == 0:
        return True, f"{entry} ({march}): ok, {took}"
    return False, f"{entry} ({march}): not built, PyTorch fallback ({done.stderr.strip()[-200:]})"


def built(entry: str, march: str) -> bool:
    """Whether the op's library for its current sources is complete on disk."""
    import importlib

    os.environ["KVSERVE_CPP_MARCH"] = march  # read by build_dir()
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr).is_built()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("marches", nargs="*", default=["native"], metavar="MARCH")
    parser.add_argument("--prebuilt", action="store_true", help="build into prebuilt_dir()")
    parser.add_argument("--strict", action="store_true", help="exit 1 if an op did not build")
    parser.add_argument("--only", action="append", choices=MODULES, help="build only these ops")
    args = parser.parse_args()
    if args.prebuilt:
        from models.cpp_ext import prebuilt_dir

        # the children and built() read it: a build is made (and found) where it will ship
        os.environ["TORCH_EXTENSIONS_DIR"] = prebuilt_dir()
    jobs = [(m, a) for a in args.marches for m in args.only or MODULES if not built(m, a)]
    failed = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for ok, line in pool.map(lambda job: build(*job), jobs):
            failed += not ok
            print(f"C++ ops: {line}", flush=True)
    if args.strict and failed:
        sys.exit(f"C++ ops: {failed} of {len(jobs)} builds failed")


if __name__ == "__main__":
    main()
