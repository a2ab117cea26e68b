"""The GPU host's package set, imitated on this machine for the device check's rehearsal
(scripts/gpu_check.sh --rehearse): with KVSERVE_HOST_PACKAGES naming packages.txt beside this
file (the distributions the host's image holds) and KVSERVE_CARRIED_PACKAGES the ones the call
carries, a Python started with this directory on its path cannot import a module that only
another distribution of this venv provides: `import redis` fails there as it does on the host.

Why a fence rather than a venv of the host's list: the host's image is ~200 distributions (JAX,
CuPy, torch for CUDA) that a CPU machine neither has nor needs; what a rehearsal must catch is
a module the server imports that the host lacks, and that is a question of names. Modules no
installed distribution claims (the standard library, this project's own folders) pass.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_dependencies(names: set[str]) -> set[str]:
    """`names` and what they require here, transitively (extras aside): the host's own versions
    of its packages bring theirs, so a module that only this venv's newer release of a host
    package imports (huggingface-hub's httpx2) is not the project's defect."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    todo, seen = list(names), set(names)
    while todo:
        try:
            reqs = requires(todo.pop()) or []
        except PackageNotFoundError:
            continue
        for line in reqs:
            req = Requirement(line)
            name = _norm(req.name)
            if name not in seen and (req.marker is None or req.marker.evaluate({"extra": ""})):
                seen.add(name)
                todo.append(name)
    return seen


def fenced_modules(host_packages: str, carried: str) -> frozenset[str]:
    """Top-level modules of this environment that no allowed distribution provides: allowed
    are the host's packages with their dependencies, the carried ones (whose dependencies must
    be on the host or carried too) and the project itself."""
    from importlib.metadata import packages_distributions

    with open(host_packages) as f:
        host = {_norm(line.strip()) for line in f if line.strip() and not line.startswith("#")}
    allowed = _with_dependencies(host) | {_norm(n) for n in carried.split()} | {"kvserve"}
    return frozenset(
        top
        for top, dists in packages_distributions().items()
        if not any(_norm(d) in allowed for d in dists)
    )


class HostFence:
    """Stands in for a finder of `sys.meta_path`: a fenced module is not found, so `import`
    raises ModuleNotFoundError and `importlib.util.find_spec` answers None, as on the host (a
    package probing for an optional one, as accelerate does for boto3, must see it absent)."""

    def __init__(self, finder: Any, fenced: frozenset[str]) -> None:
        self.finder, self.fenced = finder, fenced

    def find_spec(self, name: str, path: object = None, target: object = None) -> Any:
        if name.partition(".")[0] in self.fenced:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr: str) -> Any:  # invalidate_caches, find_distributions, ...
        return getattr(self.finder, attr)


if os.environ.get("KVSERVE_HOST_PACKAGES"):
    _fenced = fenced_modules(
        os.environ["KVSERVE_HOST_PACKAGES"], os.environ.get("KVSERVE_CARRIED_PACKAGES", "")
    )
    sys.meta_path[:] = [HostFence(finder, _fenced) for finder in sys.meta_path]
