"""The adapters an engine serves, by name. Owned by the engine thread (loads and unloads are
engine calls); `refs` and `paths` are snapshots replaced whole on every change, which the
server's thread reads to resolve a request's `model` without a call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sampling_params import LoRARef, ParamError
from models.lora import LoRAError, LoRAWeights, load_lora
from models.spec import ModelSpec


class LoRAInUse(ValueError):
    """An adapter cannot be unloaded while requests are served with it."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A read adapter: where it came from, and its weights (their fingerprint its identity)."""

    path: str
    weights: LoRAWeights


@dataclass(frozen=True, slots=True)
class LoRALimits:
    """`max_loras`: adapters whose requests run at once (0: LoRA off); `max_rank`: the
    largest rank an adapter may have."""

    max_loras: int = 0
    max_rank: int = 64

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0


class LoRARegistry:
    def __init__(self, limits: LoRALimits, spec: ModelSpec, dtype: torch.dtype) -> None:
        self.limits, self.spec, self.dtype = limits, spec, dtype
        self.adapters: dict[str, LoRAAdapter] = {}
        self.refs: dict[str, LoRARef] = {}
        self.paths: dict[str, str] = {}  # replaced whole with `refs`

    def read(self, path: str) -> LoRAAdapter:
        """An adapter's file read and checked against the model (any thread: it reads only
        what never changes); it is served once `add` names it. Raises LoRAError."""
        return LoRAAdapter(path, load_lora(path, self.spec, self.dtype, self.limits.max_rank))

    def add(self, name: str, adapter: LoRAAdapter) -> LoRARef:
        if not self.limits.enabled:
            raise LoRAError("LoRA is off on this server (--max-loras 0)")
        if not name or name in self.adapters:
            raise LoRAError(
                f"an adapter named {name!r} is already loaded"
                if name
                else "an adapter needs a name"
            )
        ref = LoRARef(name, adapter.weights.fingerprint)
        self.adapters[name] = adapter
        self.refs, self.paths = {**self.refs, name: ref}, {**self.paths, name: adapter.path}
        return ref

    def remove(self, name: str, in_use: int) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        if in_use:
            raise LoRAInUse(f"adapter {name!r} serves {in_use} requests; unload it when they end")
        del self.adapters[name]
        self.refs = {n: r for n, r in self.refs.items() if n != name}
        self.paths = {n: p for n, p in self.paths.items() if n != name}

    def weights(self, ref: LoRARef) -> LoRAWeights:
        """The weights a request's adapter reference names, or ParamError (unloaded since the
        server resolved the name, or loaded again with other weights)."""
        adapter = self.adapters.get(ref.name)
        if adapter is None or adapter.weights.fingerprint != ref.key:
            raise ParamError("model", f"the adapter {ref.name!r} is no longer loaded")
        return adapter.weights

    def describe(self) -> str:
        """The banner's line: the limits, and each adapter's rank, targets and memory."""
        if not self.limits.enabled:
            return "off"
        head = f"at most {self.limits.max_loras} at once, rank <= {self.limits.max_rank}"
        each = [
            f"{name} (rank {a.weights.rank}, {a.weights.nbytes / 2**20:.2f} MiB, "
            f"{len(a.weights.targets)} projections)"
            for name, a in self.adapters.items()
        ]
        return head + ("; " + ", ".join(each) if each else "; none loaded")
