"""Build kvserve's C++ ops ahead of their first use, all at once: one process per op and -march
(`KVSERVE_CPP_MARCH`), as many at a time as there are cores. Each takes ~15 s of g++ alone, and
at first use they would build one after another inside whatever started first (a server's
startup, a test). An op that cannot build here is reported and left to its PyTorch fallback.

    .venv/bin/python scripts/build_ops.py [MARCH ...]     # default: native
    python scripts/build_ops.py --prebuilt --strict x86-64-v3 x86-64-v4 x86-64-v4-bf16  # an image's

--prebuilt writes into the install's prebuilt directory (kernels/build.py `prebuilt_dir()`, under
the environment's prefix) instead of TORCH_EXTENSIONS_DIR: a later start without a compiler loads
the best portable level there that its CPU runs. --strict fails (exit 1) if any op did not build,
so an image never ships without the ops it promises. --only NAME (an op's name, e.g.
kvserve_cpu_fused) limits the ops built.

The ops are kernels/ops.py's `ALL`, imported from wherever this interpreter finds `kernels` (the
venv's editable install, or an installed wheel): the build directory is named by the sources'
content, so either copy of the same sources builds the same thing. An op that calls others
(`needs`) loads them first, so its child may wait on their builds (each under its own lock).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from kernels.ops import ALL, BY_NAME

NAMES = tuple(op.name for op in ALL)


def build(name: str, march: str) -> tuple[bool, str]:
    env = {**os.environ, "KVSERVE_CPP_MARCH": march}
    code = f"import sys, kernels.ops as m; sys.exit(m.BY_NAME[{name!r}].load() is None)"
    t = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    took = f"{time.monotonic() - t:.0f} s"
    if done.returncode == 0:
        return True, f"{name} ({march}): ok, {took}"
    return False, f"{name} ({march}): not built, PyTorch fallback ({done.stderr.strip()[-200:]})"


def built(name: str, march: str) -> bool:
    """Whether the op's library for its current sources is complete on disk."""
    os.environ["KVSERVE_CPP_MARCH"] = march  # read by build_dir()
    return BY_NAME[name].is_built()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("marches", nargs="*", default=["native"], metavar="MARCH")
    parser.add_argument("--prebuilt", action="store_true", help="build into prebuilt_dir()")
    parser.add_argument("--strict", action="store_true", help="exit 1 if an op did not build")
    parser.add_argument("--only", action="append", choices=NAMES, help="build only these ops")
    args = parser.parse_args()
    if args.prebuilt:
        from kernels.build import prebuilt_dir

        # the children and built() read it: a build is made (and found) where it will ship
        os.environ["TORCH_EXTENSIONS_DIR"] = prebuilt_dir()
    jobs = [(m, a) for a in args.marches for m in args.only or NAMES if not built(m, a)]
    failed = 0
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for ok, line in pool.map(lambda job: build(*job), jobs):
            failed += not ok
            print(f"C++ ops: {line}", flush=True)
    if args.strict and failed:
        sys.exit(f"C++ ops: {failed} of {len(jobs)} builds failed")


if __name__ == "__main__":
    main()
