"""Attention backends, in priority order, and the choice among them."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
from engine.attention.torch_backend import TorchBackend
from models.spec import ModelSpec

BACKENDS: list[type[AttentionBackend]] = [TorchBackend]

__all__ = ["AttentionBackend", "AttentionStep", "StepMetadata", "BACKENDS", "select_backend"]


def support_matrix(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, block_size: int
) -> dict[str, list[str]]:
    return {b.name: b.unsupported_reasons(spec, device, dtype, block_size) for b in BACKENDS}


def select_backend(
    spec: ModelSpec, device: torch.device, dtype: torch.dtype, block_size: int, forced: str = "auto"
) -> type[AttentionBackend]:
    matrix = support_matrix(spec, device, dtype, block_size)
    by_name = {b.name: b for b in BACKENDS}
    if forced != "auto":
        if forced not in by_name:
            raise ValueError(f"unknown attention backend {forced!r}; known: {sorted(by_name)}")
        if matrix[forced]:
            raise ValueError(
                f"attention backend {forced!r} cannot serve this model: "
                + "; ".join(matrix[forced])
            )
        return by_name[forced]
    for backend in BACKENDS:
        if not matrix[backend.name]:
            return backend
    # Nothing is clean: the reference backend still computes the right answer, only slowly.
    return TorchBackend
