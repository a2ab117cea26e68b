"""Attention backends in priority order, the kernel-support matrix, and the choice among them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
from engine.attention.flashinfer_backend import FlashInferBackend
from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict, format_matrix
from engine.attention.reference_backend import ReferenceBackend
from engine.attention.torch_backend import TorchBackend
from engine.attention.xformers_backend import XFormersBackend
from models.spec import ModelSpec

# the reference (gather + SDPA, any device) last: it serves only where forced or nothing else can
BACKENDS: list[type[AttentionBackend]] = [
    FlashInferBackend,
    XFormersBackend,
    TorchBackend,
    ReferenceBackend,
]
SLOW_ONLY = ("dtype",)  # requirements that cost speed, not correctness (waivable)

__all__ = [
    "AttentionBackend",
    "AttentionStep",
    "StepMetadata",
    "BACKENDS",
    "BackendChoice",
    "DeviceFacts",
    "select_backend",
]
log = logging.getLogger("kvserve.attention")


@dataclass(frozen=True, slots=True)
class BackendChoice:
    backend: type[AttentionBackend]
    reason: str
    table: str  # the matrix as printed at startup
    fast: bool


def support_matrix(
    spec: ModelSpec,
    facts: DeviceFacts,
    dtype: torch.dtype,
    block_size: int,
    failed: dict[str, str] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> dict[str, Verdict]:
    """Backend -> verdict; `failed` adds a backend's warm-up failure (its kernels could not
    build or run here) as the "warm-up" requirement; `kv_dtype`: the cache's, where it is not
    the serving dtype."""
    needs = ModelNeeds.of(spec, int8_kv=kv_dtype == torch.int8)
    matrix = {b.name: b.check(needs, facts, dtype, block_size) for b in BACKENDS}
    for name, why in (failed or {}).items():
        matrix[name]["warm-up"] = why
    return matrix


def _failures(verdict: Verdict) -> list[str]:
    return [f"{req}: {why}" for req, why in verdict.items() if why]


def select_backend(
    spec: ModelSpec,
    facts: DeviceFacts,
    dtype: torch.dtype,
    block_size: int,
    forced: str = "auto",
    allow_slow_dtype: bool = False,
    require_fast_kernels: bool = False,
    failed: dict[str, str] | None = None,
    kv_dtype: torch.dtype | None = None,
) -> BackendChoice:
    """The first backend in priority order that meets every requirement, or the forced one.
    Raises ValueError with the reasons when nothing (or not the forced backend) can serve.
    `failed`: backends that failed their warm-up, with the reason (passed over, shown)."""
    matrix = support_matrix(spec, facts, dtype, block_size, failed, kv_dtype)
    if allow_slow_dtype:  # the user accepted the slow dtype: it no longer disqualifies
        matrix = {n: {r: w for r, w in v.items() if r not in SLOW_ONLY} for n, v in matrix.items()}
    by_name = {b.name: b for b in BACKENDS}
    if forced != "auto":
        if forced not in by_name:
            raise ValueError(f"unknown attention backend {forced!r}; known: {sorted(by_name)}")
        chosen, why = by_name[forced], "forced by --attention-backend"
        if _failures(matrix[forced]):
            raise ValueError(
                f"attention backend {forced!r} cannot serve this model on {facts.label}: "
                + "; ".join(_failures(matrix[forced]))
                + "\n"
                + format_matrix(matrix, forced, "refused")
            )
    else:
        clean = [b for b in BACKENDS if not _failures(matrix[b.name])]
        if not clean:
            # backends that could run on this device first: their reasons are the ones to act on
            order = sorted(matrix, key=lambda n: matrix[n].get("device") is not None)
            reasons = "; ".join(f"{n}: {', '.join(_failures(matrix[n]))}" for n in order)
            raise ValueError(
                f"no attention backend can serve this model on {facts.label}: {reasons}\n"
                + format_matrix(matrix, "none", "refused")
            )
        chosen = clean[0]
        passed = [b.name for b in BACKENDS[: BACKENDS.index(chosen)]]
        why = "first in priority order meeting every requirement"
        if passed:
            why += f" ({', '.join(f'{name} passed over' for name in passed)})"
    fast = chosen.is_fast_on(facts)
    table = format_matrix(matrix, chosen.name, why)
    if not fast:
        message = f"attention backend {chosen.name} is the slow general path on {facts.label}"
        if require_fast_kernels:
            raise ValueError(message + " and --require-fast-kernels is set\n" + table)
        log.warning("%s: expect 2-5x slower attention", message)
    return BackendChoice(chosen, why, table, fast)
