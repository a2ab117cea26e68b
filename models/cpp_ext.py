"""kvserve's C++ ops: `.cpp` files beside the module that uses them, compiled at first use.

Each source registers its ops with `TORCH_LIBRARY(<name>, m)` and is built as the extension
`<name>` by `torch.utils.cpp_extension.load` for this CPU (`target_arch`; g++ and ninja; ~15 s
once per source). A build lives under TORCH_EXTENSIONS_DIR in a directory named by the content of
what it is built from (its sources, flags, torch, the target and, for `native`, this CPU's
flags): a second checkout of the same sources finds it built, an edit builds anew, and a start
that finds its library complete loads it without running ninja (which took ~0.4 s an op in every
process, ~3 s of each server start). Where it cannot build (no compiler, or KVSERVE_NO_CPP=1),
`load()` returns None and callers keep their pure-PyTorch paths; tests compare the two.

Consumers: models/cpu_fused.py (fused elementwise ops for models/layers.py),
models/gguf_linear.py (GGUF block matmuls) and
engine/attention/cpu_decode.py and cpu_prefill.py (paged decode and prefill attention for the torch
backend). The build logic
lives here, in models/, because models must not import the engine.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
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


def target_arch() -> str:
    """The -march the ops are built for: this CPU, or KVSERVE_CPP_MARCH (e.g. x86-64-v3, AVX2
    without AVX-512: how scripts/test.sh builds them to run the AVX2 paths on any CPU)."""
    return os.environ.get("KVSERVE_CPP_MARCH", "native")


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
    """One C++ source compiled at first `load()` into `torch.ops.<name>`; `headers` are the
    files beside it that it includes (ninja rebuilds on their change; `inputs` lists them all)."""

    def __init__(self, name: str, source: Path, headers: tuple[Path, ...] = ()) -> None:
        self.name = name
        self.source = source
        self.inputs = (source, *headers)
        self._lock = threading.Lock()
        self._ops: Any = None
        self._tried = False

    def load(self) -> Any:
        """The compiled ops namespace (`torch.ops.<name>`), or None where they cannot be built
        (no compiler, or KVSERVE_NO_CPP=1)."""
        if self._tried:  # the hot path: no lock once decided
            return self._ops
        with self._lock:
            if self._tried:
                return self._ops
            self._tried = True
            if os.environ.get("KVSERVE_NO_CPP") == "1":
                return None
            try:
                library = os.path.join(self.build_dir(), f"{self.name}.so")
                if self.is_built():
                    torch.ops.load_library(library)
                else:
                    self._build()
                self._ops = getattr(torch.ops, self.name)
            except Exception as e:  # noqa: BLE001 - any build failure means: use the fallback
                log.warning(
                    "kvserve's C++ ops %s unavailable (%s); using PyTorch ops", self.name, e
                )
            return self._ops

    def build_dir(self) -> str:
        """Where this source builds for `target_arch()`: named by the content it builds from."""
        arch = target_arch()
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
            os.environ.get("TORCH_EXTENSIONS_DIR")
            or os.path.expanduser("~/.cache/torch_extensions"),
            f"{self.name}-{arch}-{digest.hexdigest()[:16]}",
        )

    def is_built(self) -> bool:
        """Whether a complete library for these sources and this target is on disk."""
        return os.path.isfile(os.path.join(self.build_dir(), COMPLETE))

    def _build(self) -> None:
        from torch.utils.cpp_extension import load

        # the `ninja` that pip installs sits next to this interpreter, maybe not on PATH
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

        build_dir = self.build_dir()
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
                extra_cflags=[*CFLAGS, f"-march={target_arch()}"],
                extra_ldflags=LDFLAGS,
                build_directory=build_dir,
                is_python_module=False,
                verbose=False,
            )
            Path(build_dir, COMPLETE).write_text("")
