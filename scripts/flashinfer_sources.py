"""Prove, without a GPU, that a FlashInfer package (the trimmed one scripts/gpu_check.sh carries)
holds every source and header of the JIT modules this project builds: generate each module's
sources and ninja file as FlashInfer's JIT does, then run every nvcc compile command as a
dependency scan (`nvcc -M`: the preprocessor only, host and device passes) instead of a compile.

    PYTHONPATH=<site> python scripts/flashinfer_sources.py [--cuda-include DIR ...]

The modules: batch decode (CUDA cores, fa2), batch prefill fa2 and fa3 (sm90), and the paged-KV
append, for bfloat16 and float16 at head_dim 64 and 128 (the engine's FlashInferBackend,
engine/attention/flashinfer_backend.py). `--cuda-include` adds a CUDA library's headers that a
partial toolkit here lacks (curand's, which CUTLASS's utilities include); a header missing from
the package is a defect of the trim, one missing from the toolkit is reported as such.

`--prebuild` builds an sm90 bfloat16 warm-up's modules in one parallel ninja run (the device
check's compile step); `--time-one-unit` compiles one fa3 unit here and times it (its bound).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MISSING = re.compile(r"fatal error: (\S+): No such file or directory")


def module_specs(
    head_dims: tuple[int, ...],
    dtypes: tuple | None = None,
    prefill: tuple[str, ...] = ("fa2", "fa3"),
) -> list:
    import torch
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
    from flashinfer.jit.page import gen_page_module

    specs = [gen_page_module()]
    for dtype in dtypes or (torch.bfloat16, torch.float16):
        for d in head_dims:
            common = (dtype, dtype, dtype, torch.int32, d, d, 0, False, False)
            specs.append(gen_batch_decode_module(*common))
            for backend in prefill:
                specs.append(gen_batch_prefill_module(backend, *common, False))
    return specs


def prebuild(head_dims: tuple[int, ...]) -> int:
    """Build the modules an sm90 warm-up of a bfloat16 model loads (page append, decode, fa3
    prefill) in ONE ninja run, so all their nvcc units compile at once (MAX_JOBS); the engine's
    warm-up then finds them built. FlashInfer's own JIT builds module after module."""
    import torch
    from flashinfer.jit.core import build_jit_specs

    start = time.time()
    specs = module_specs(head_dims, (torch.bfloat16,), ("fa3",))
    build_jit_specs(specs, skip_prebuilt=False)
    print(f"FlashInfer: {len(specs)} modules built in parallel in {time.time() - start:.0f} s")
    return 0


def time_one_unit(head_dim: int) -> int:
    """Compile (for real, not a scan) the fa3 prefill module's first nvcc unit and time it: the
    CPU-side cost that the device check's compile step is bounded by (no GPU needed)."""
    import torch

    spec = module_specs((head_dim,), (torch.bfloat16,), ("fa3",))[-1]
    units = nvcc_commands(spec)
    start = time.time()
    done = subprocess.run(units[0], capture_output=True, text=True)
    print(
        f"fa3 prefill: {len(units)} nvcc units; the first took {time.time() - start:.0f} s "
        f"on one core here (exit {done.returncode})"
    )
    if done.returncode:
        print(done.stderr[-2000:])
    return done.returncode


def nvcc_commands(spec) -> list[list[str]]:
    """The nvcc commands (argv) of a module's ninja build, in build order (written first)."""
    spec.write_ninja()
    listed = subprocess.run(
        ["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-t", "commands"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    commands = (shlex.split(line) for line in listed)
    return [argv for argv in commands if argv and argv[0].endswith("nvcc")]


def scan_commands(spec, cuda_includes: list[str]) -> list[tuple[str, list[str]]]:
    """(source, the nvcc command as a dependency scan) for each CUDA source of a module."""
    extra = [f for inc in cuda_includes for f in ("-isystem", inc)]
    scans = []
    for argv in nvcc_commands(spec):
        source = argv[argv.index("-c") + 1]
        kept, skip = [], 0
        for arg in argv:
            if skip:
                skip -= 1
            elif arg == "--generate-dependencies-with-compile":
                pass
            elif arg in ("-MF", "-o"):
                skip = 1
            elif arg == "-c":
                kept += ["-M", source, "-o", os.devnull]
                skip = 1
            else:
                kept.append(arg)
        scans.append((source, kept[:1] + extra + kept[1:]))
    return scans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-include", action="append", default=[])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--prebuild", action="store_true", help=prebuild.__doc__)
    parser.add_argument("--time-one-unit", action="store_true", help=time_one_unit.__doc__)
    args = parser.parse_args()
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", tempfile.mkdtemp(prefix="fi_sources_"))
    import flashinfer

    if args.prebuild:
        return prebuild(tuple(int(d) for d in args.head_dims.split(",")))
    if args.time_one_unit:
        return time_one_unit(int(args.head_dims.split(",")[0]))

    package = Path(flashinfer.__file__).parent
    toolkit_gaps: set[str] = set()
    defects: list[str] = []
    start = time.time()
    head_dims = tuple(int(d) for d in args.head_dims.split(","))
    scans = [s for spec in module_specs(head_dims) for s in scan_commands(spec, args.cuda_include)]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        results = pool.map(lambda s: subprocess.run(s[1], capture_output=True, text=True), scans)
    count = len(scans)
    for (source, _), done in zip(scans, results):
        if done.returncode == 0:
            continue
        missing = MISSING.search(done.stderr)
        if missing is None:
            defects.append(f"{Path(source).name}: {done.stderr.strip()[-400:]}")
        elif missing.group(1).startswith(("curand", "cublas", "cusparse", "cufft")):
            toolkit_gaps.add(missing.group(1))
        else:
            defects.append(f"{Path(source).name}: {missing.group(1)} not found")
    print(
        f"{count} sources of FlashInfer's JIT scanned against {package} in "
        f"{time.time() - start:.0f} s"
    )
    if toolkit_gaps:
        print(
            "not checked past a header this CUDA toolkit lacks (not FlashInfer's):",
            ", ".join(sorted(toolkit_gaps)),
        )
    for line in defects:
        print("MISSING", line)
    return 1 if defects else 0


if __name__ == "__main__":
    sys.exit(main())
