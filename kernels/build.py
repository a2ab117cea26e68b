"""Compiling kvserve's C++ ops: `CppOps`, one source built at first use (kernels/ops.py declares
every op; the `.cpp`/`.h` files sit beside this module).

Each source registers its ops with `TORCH_LIBRARY(<name>, m)` and is built as the extension
`<name>` by `torch.utils.cpp_extension.load` for this CPU (`target_arch`; g++ and ninja; ~15 s
once per source). A build lives under TORCH_EXTENSIONS_DIR in a directory named by the content of
what it is built from (its sources, flags, torch, the target and, for `native`, this CPU's
flags), never by where the sources sit: a second checkout of the same sources finds it built, an
edit builds anew, and a start that finds its library complete loads it without running ninja
(which took ~0.4 s an op in every process, ~3 s of each server start). Where it cannot build (no
compiler, or KVSERVE_NO_CPP=1), `load()` returns None and callers keep their pure-PyTorch paths;
tests compare the two.

An install without a compiler (the CPU image) loads builds made ahead of time:
`scripts/build_ops.py --prebuilt x86-64-v3 x86-64-v4` writes portable builds into
`prebuilt_dir()`, and a start that finds no `native` build and no compiler loads the best of them
this CPU runs (`PORTABLE`). Where a compiler is present the start builds for this CPU as before
(the AVX-512 BF16 and VNNI paths exist only in a native build).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("kvserve.ops")

# -fopenmp: at::parallel_for is a header template; compiled without OpenMP it runs its whole range
# on the calling thread. Linking with it adds libgomp.so.1, the soname torch has already loaded
# from torch/lib, so the ops share torch's thread team.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


# written in a build directory once its library is complete: a start that finds it loads the
# library as it is (a build killed mid-way leaves none, and the next start builds under the lock)
COMPLETE = "kvserve.complete"


# The portable -march levels an install may prebuild, best first, with the /proc/cpuinfo flags
# each assumes (`abm` is how Linux names LZCNT): without a compiler a start loads the first one
# this CPU has every flag of. v3 (AVX2, FMA, F16C) is any x86 server since 2013 (Haswell, Zen 1);
# v4 adds the AVX-512 paths of cpu_simd.h and gguf_linear.cpp.
# v4-bf16 adds what the fast paths of Zen 4/5 and Sapphire Rapids need (gguf_q8_bf16.h's pair
# dots, the VNNI int8 rows): v4 plus AVX512-BF16 and VNNI, no more (no AMX, no FP16, no
# vendor-only instruction), so one build serves both vendors.
_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
PORTABLE = {
    "x86-64-v4-bf16": (*_V4, "avx512_bf16", "avx512_vnni"),
    "x86-64-v4": _V4,
    "x86-64-v3": _V3,
}
# a level that is not a compiler's -march name: its flags
_LEVEL_FLAGS = {"x86-64-v4-bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"]}


def arch_flags(arch: str) -> list[str]:
    """The compiler flags of a -march name or a PORTABLE level."""
    return _LEVEL_FLAGS.get(arch, [f"-march={arch}"])


def target_arch() -> str:
    """The -march the ops are built for: this CPU, or KVSERVE_CPP_MARCH (e.g. x86-64-v3, AVX2
    without AVX-512: how scripts/test.sh builds them to run the AVX2 paths on any CPU)."""
    return os.environ.get("KVSERVE_CPP_MARCH", "native")


def extensions_dir() -> str:
    """Where builds are made and looked for first (writable): TORCH_EXTENSIONS_DIR, as torch."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")


def prebuilt_dir() -> str:
    """Where this install's ahead-of-time builds are looked for second (read-only at startup):
    KVSERVE_PREBUILT_OPS, else share/kvserve/ops under the environment's prefix, so a venv (the
    images' /opt/kvserve) carries its builds with it."""
    return os.environ.get("KVSERVE_PREBUILT_OPS") or os.path.join(
        sys.prefix, "share", "kvserve", "ops"
    )


def compiler() -> str | None:
    """The C++ compiler torch's build would run (CXX, else c++ on PATH), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def portable_targets() -> list[str]:
    """The PORTABLE levels this CPU runs, best first (none off x86)."""
    line = _cpu_flags()
    flags = set(line.split(":", 1)[1].split()) if ":" in line else set()
    return [arch for arch, needs in PORTABLE.items() if flags.issuperset(needs)]


@functools.cache
def _cpu_flags() -> str:
    """This CPU's feature flags, which `-march=native` builds for (a home directory moved to
    another kind of CPU must not load a library built for this one)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor()


class CppOps:
    """One C++ source compiled at first `load()` into `torch.ops.<name>`. `headers` are the
    files it includes (ninja rebuilds on their change; `inputs` lists them all and names the
    build). `needs` are the ops whose kernels this one calls through the dispatcher by name (a
    link no import shows): they are loaded first, and where one cannot be, neither is this."""

    def __init__(
        self,
        name: str,
        source: Path,
        headers: tuple[Path, ...] = (),
        needs: tuple[CppOps, ...] = (),
    ) -> None:
        self.name = name
        self.source = source
        self.inputs = (source, *headers)
        self.needs = needs
        self._lock = threading.Lock()
        self._ops: Any = None
        self._tried = False
        self.library: str | None = None  # the file loaded, once loaded (which build, where)

    def load(self) -> Any:
        """The compiled ops namespace (`torch.ops.<name>`), or None where they cannot be built
        or found prebuilt (no compiler, or KVSERVE_NO_CPP=1)."""
        if self._tried:  # the hot path: no lock once decided
            return self._ops
        with self._lock:
            if self._tried:
                return self._ops
            self._tried = True
            if os.environ.get("KVSERVE_NO_CPP") == "1":
                return None
            missing = [need.name for need in self.needs if need.load() is None]
            if missing:  # its lookups by name would throw at the first call
                log.warning("kvserve's C++ ops %s unavailable: needs %s", self.name, missing)
                return None
            try:
                self._ops = self._load(target_arch())
            except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                log.warning(
                    "kvserve's C++ ops %s unavailable (%s); using PyTorch ops", self.name, e
                )
            return self._ops

    def _load(self, arch: str) -> Any:
        """A complete build for `arch` as it is; else a build now (where a compiler is, for
        `native`); else, for `native`, the best prebuilt portable build this CPU runs."""
        failure: Exception | None = None
        library = self.find(arch)
        if library is None and (arch != "native" or compiler() is not None):
            try:
                self._build(arch)  # torch's load() loads the library it built
                self.library = os.path.join(self.build_dir(arch), f"{self.name}.so")
                return getattr(torch.ops, self.name)
            except Exception as e:  # noqa: BLE001 - a portable build may still serve
                failure = e
        if library is None and arch == "native":
            library = next(filter(None, map(self.find, portable_targets())), None)
            if library is not None:
                log.info("kvserve's C++ ops %s: prebuilt %s", self.name, library)
        if library is None:
            raise failure or RuntimeError(
                f"no C++ compiler and no prebuilt build for this CPU in {prebuilt_dir()}"
            )
        torch.ops.load_library(library)
        self.library = library
        return getattr(torch.ops, self.name)

    def build_dir(self, arch: str | None = None, root: str | None = None) -> str:
        """Where this source builds for `arch` (default `target_arch()`) under `root` (default
        `extensions_dir()`): named by the content it builds from."""
        arch = arch or target_arch()
        digest = hashlib.sha256()
        for path in self.inputs:
            digest.update(path.read_bytes())
        built_for = (
            CFLAGS,
            LDFLAGS,
            torch.__version__,
            arch,
            _cpu_flags() if arch == "native" else "",
        )
        digest.update(repr(built_for).encode())
        return os.path.join(
            root or extensions_dir(), f"{self.name}-{arch}-{digest.hexdigest()[:16]}"
        )

    def is_built(self) -> bool:
        """Whether a complete library for these sources and this target is in extensions_dir()
        (where a build for it would go)."""
        return os.path.isfile(os.path.join(self.build_dir(), COMPLETE))

    def find(self, arch: str) -> str | None:
        """The complete library for `arch` in extensions_dir() or else prebuilt_dir(), or None."""
        for root in (extensions_dir(), prebuilt_dir()):
            build = self.build_dir(arch, root)
            if os.path.isfile(os.path.join(build, COMPLETE)):
                return os.path.join(build, f"{self.name}.so")
        return None

    def _build(self, arch: str) -> None:
        from torch.utils.cpp_extension import load

        # the `ninja` that pip installs sits next to this interpreter, maybe not on PATH
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

        build_dir = self.build_dir(arch)
        os.makedirs(build_dir, exist_ok=True)
        # torch guards a build with a plain `lock` file that a process killed mid-build leaves
        # behind, and every later start then waits on it forever. An flock is released by the
        # kernel when its holder dies: whoever holds it is the only builder, so a `lock` file it
        # finds is stale.
        with open(os.path.join(build_dir, "kvserve.flock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                log.warning("removing a stale build lock left by a killed build")
                os.remove(stale)
            load(
                name=self.name,
                sources=[str(self.source)],
                extra_cflags=[*CFLAGS, *arch_flags(arch)],
                extra_ldflags=LDFLAGS,
                build_directory=build_dir,
                is_python_module=False,
                verbose=False,
            )
            Path(build_dir, COMPLETE).write_text("")
