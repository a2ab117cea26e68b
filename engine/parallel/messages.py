"""What rank 0 and the other tensor-parallel ranks say to each other over their control pipes,
as typed messages (a leaf: both sides import it, it imports neither). Rank 0 -> a worker:
`Setup` once, `Load` (rank 0's dtype choice), `Build` (its pool decisions), then per step a
`Step` and each KV copy it decides (`KVCopy`, `CopyPrefix`), until `Stop`. A worker -> rank 0:
`Report`s of its start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from engine.config import EngineConfig
from models.tp_plan import TPPlan


@dataclass(frozen=True, slots=True)
class Setup:
    config: EngineConfig
    plan: TPPlan
    port: int  # the process group's rendezvous
    device: str
    threads: int
    shm: str | None  # the shared-memory all-reduce's name (None: gloo or NCCL)


@dataclass(frozen=True, slots=True)
class Load:
    dtype: str  # rank 0's dtype choice (a startup measurement), as torch spells it


@dataclass(frozen=True, slots=True)
class WorkerBuild:
    """What rank 0 decided that a worker's pool must match: every rank holds the same blocks."""

    backend: str
    block_size: int
    num_blocks: int
    kv_dtype: torch.dtype
    host_blocks: int


@dataclass(frozen=True, slots=True)
class Step:
    """One step's batch plan: (block table, first position, tokens) per sequence, the step's
    token ids, and the rows whose logits every rank computes a vocabulary part of ([]: none)."""

    seqs: list[tuple[list[int], int, int]]
    token_ids: list[int]
    logits_rows: list[int]


@dataclass(frozen=True, slots=True)
class KVCopy:
    """A host-tier copy: "out" device blocks `a` into storage slots `b`; "in" slots `a` into
    device blocks `b`."""

    direction: Literal["out", "in"]
    a: list[int]
    b: list[int]


@dataclass(frozen=True, slots=True)
class CopyPrefix:
    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Report:
    state: Literal["joining", "ready", "failed"]
    detail: str | None = None


ToWorker = Setup | Load | WorkerBuild | Step | KVCopy | CopyPrefix | Stop
