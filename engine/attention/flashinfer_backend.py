"""FlashInfer paged attention (CUDA only; the `gpu` extra). Written against flashinfer-python
0.7.2.post1's wrapper API (BatchDecodeWithPagedKVCacheWrapper / BatchPrefillWithPagedKVCacheWrapper:
plan, then run per layer); the calls are bound to the real signatures by
tests/test_kernel_contracts.py and exercised on a GPU by tests/test_gpu.py.

KV layout: one 5-D tensor per KV group, [num_blocks, 2, block_size, kv_heads, head_dim] (NHD
pages, K and V side by side). Page tables are CSR on the host: `indptr` int32 [seqs + 1],
`indices` int32 [pages], `last_page_len` int32 [seqs] in 1..page_size. `plan` reads them on the
host anyway (it copies device ones back, a sync each), then uploads them itself.

Resources, allocated once: one float workspace (128 MiB, zeroed as FlashInfer requires on first
use), allocated before the KV pool is sized and shared by every wrapper (a run's split-K
scratch; runs are sequential on one stream); one wrapper per (decode|prefill, layer geometry),
created at first use and re-planned each step (each wrapper owns 8 MiB of device and 8 MiB of
pinned int workspace, so making them per step would allocate 16 MiB per geometry per step).
A step plans a geometry lazily, at its first layer of that geometry: the draft head's steps
plan only the draft layer's geometry, not every target geometry again.

Decode steps may also run as CUDA graphs (engine/runner/cuda_graphs.py): `graph_step` gives a step
whose wrappers were made with `use_cuda_graph=True` over fixed page-table buffers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata, paged_layer_cache
from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict, gpu_verdict, model_refusals
from models.spec import ModelSpec

HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64)
WORKSPACE_BYTES = 128 * 1024 * 1024
VERSION = "0.7.2.post1"  # the flashinfer-python these calls are written against (pyproject)

Geometry = tuple[int, int, int]  # (query heads, KV heads, head_dim)


def page_table(
    block_tables: list[list[int]], seq_lens: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR page table on the host: (indptr int32 [n + 1], indices int32 [pages], last_page_len
    int32 [n], each in 1..block_size)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    pages = (lens + block_size - 1) // block_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int32)
    for i, (table, p) in enumerate(zip(block_tables, pages.tolist())):
        indices[indptr[i] : indptr[i] + p] = table[:p]
    last = (lens - (pages - 1) * block_size).astype(np.int32)
    return torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last)


def plan_kwargs(spec: ModelSpec, dtype: torch.dtype) -> dict[str, Any]:
    window = spec.sliding_window - 1 if spec.sliding_window else -1  # window_left: inclusive
    return {
        "window_left": window,
        "logits_soft_cap": spec.extra.get("attn_logit_softcapping"),
        "q_data_type": dtype,
        "kv_data_type": dtype,
    }


class FlashInferStep(AttentionStep):
    """One step's attention: the page table on the host, planned per geometry at first use."""

    def __init__(self, backend: FlashInferBackend, meta: StepMetadata) -> None:
        self.backend = backend
        bs = backend.block_size
        self.kv_indptr, self.kv_indices, self.last_len = page_table(
            meta.block_tables, meta.seq_lens, bs
        )
        self.decode_only = all(q == 1 for q in meta.query_lens)
        qo = np.zeros(meta.num_seqs + 1, dtype=np.int32)
        np.cumsum(meta.query_lens, out=qo[1:])
        self.qo_indptr = torch.from_numpy(qo)
        slots = meta.slot_mapping  # on the device already (model_runner.step_metadata)
        self.slot_block, self.slot_offset = slots // bs, slots % bs

    def _wrapper(self, geometry: Geometry) -> Any:
        backend = self.backend
        kind = "decode" if self.decode_only else "prefill"
        wrapper = backend.wrapper(kind, geometry)
        if backend.planned_by.get((kind, geometry)) is not self:
            self._plan(wrapper, geometry)
            backend.planned_by[(kind, geometry)] = self
        return wrapper

    def _plan(self, wrapper: Any, geometry: Geometry) -> None:
        heads, kv_heads, head_dim = geometry
        backend = self.backend
        kw = plan_kwargs(backend.spec, backend.dtype)
        # the decode wrapper's plan takes the page table and geometry; the prefill wrapper's the
        # query rows' CSR offsets before them, and causal masking
        pages = (self.kv_indptr, self.kv_indices, self.last_len)
        geometry_args = (heads, kv_heads, head_dim, backend.block_size)
        if self.decode_only:
            wrapper.plan(*pages, *geometry_args, **kw)
        else:
            wrapper.plan(self.qo_indptr, *pages, *geometry_args, causal=True, **kw)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        backend = self.backend
        cache = paged_layer_cache(backend, layer_idx, k, v, self.slot_block, self.slot_offset, 1)
        wrapper = self._wrapper(backend.layer_geometry[layer_idx])
        return wrapper.run(q.contiguous(), cache)


class FlashInferGraphStep(FlashInferStep):
    """A decode step for CUDA graphs over a fixed batch size: wrappers made with
    `use_cuda_graph=True` over fixed page-table buffers, planned for every geometry before each
    replay (plan cannot run inside a graph), and slot tensors that stay at one address."""

    def __init__(self, backend: FlashInferBackend, batch_size: int, max_pages: int) -> None:
        self.backend = backend
        self.decode_only = True
        self.batch_size = batch_size
        device = backend.device
        self.slot_block = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.slot_offset = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.wrappers: dict[Geometry, Any] = {}
        import flashinfer

        for geometry in backend.geometries:
            heads, kv_heads, _ = geometry
            self.wrappers[geometry] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=heads // kv_heads >= 4,
                paged_kv_indptr_buffer=torch.zeros(
                    batch_size + 1, dtype=torch.int32, device=device
                ),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=device),
                paged_kv_last_page_len_buffer=torch.zeros(
                    batch_size, dtype=torch.int32, device=device
                ),
            )

    def update(self, meta: StepMetadata) -> None:
        """Plan every geometry for this (padded) batch and point the slots at its new tokens."""
        bs = self.backend.block_size
        self.kv_indptr, self.kv_indices, self.last_len = page_table(
            meta.block_tables, meta.seq_lens, bs
        )
        slots = meta.slot_mapping
        torch.floor_divide(slots, bs, out=self.slot_block)
        torch.remainder(slots, bs, out=self.slot_offset)
        for geometry, wrapper in self.wrappers.items():
            self._plan(wrapper, geometry)

    def _wrapper(self, geometry: Geometry) -> Any:
        return self.wrappers[geometry]


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    kv_layout = ("blocks", "kv", "slots", "heads", "dim")  # NHD pages, K and V side by side
    supports_cuda_graphs = True

    @classmethod
    def check(
        cls, needs: ModelNeeds, facts: DeviceFacts, dtype: torch.dtype, block_size: int
    ) -> Verdict:
        verdict = gpu_verdict(facts, "flashinfer", (7, 5), dtype)
        if dtype == torch.bfloat16 and facts.capability is not None and facts.capability < (8, 0):
            verdict["dtype"] = "bfloat16 needs sm80+"
        if block_size not in PAGE_SIZES:
            verdict["block size"] = f"page size {block_size} not in {PAGE_SIZES}"
        return verdict | model_refusals(needs, head_dims=HEAD_DIMS, mixed_windows=False)

    @classmethod
    def workspace_bytes(cls) -> int:
        return WORKSPACE_BYTES

    @classmethod
    def allocate_workspace(cls, device: torch.device) -> torch.Tensor:
        """The one float workspace, zeroed (FlashInfer: "must be initialized to 0 for its first
        use"). Allocated by the builder before it sizes the KV pool from free memory."""
        return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def __init__(
        self,
        spec: ModelSpec,
        kv_caches: list[torch.Tensor],
        block_size: int,
        workspace: torch.Tensor | None = None,
    ) -> None:
        super().__init__(spec, kv_caches, block_size)
        self.device = kv_caches[0].device
        self.dtype = kv_caches[0].dtype
        self.layer_geometry: list[Geometry] = [
            (lay.num_heads, lay.num_kv_heads, lay.head_dim) for lay in spec.layers
        ]
        self.geometries = sorted(set(self.layer_geometry))
        if workspace is None:
            workspace = self.allocate_workspace(self.device)
        self.workspace = workspace
        self.wrappers: dict[tuple[str, Geometry], Any] = {}
        self.planned_by: dict[tuple[str, Geometry], FlashInferStep] = {}

    def wrapper(self, kind: str, geometry: Geometry) -> Any:
        """The one wrapper of this kind and geometry (created at first use, kept)."""
        key = (kind, geometry)
        wrapper = self.wrappers.get(key)
        if wrapper is None:
            import flashinfer

            if kind == "decode":
                heads, kv_heads, _ = geometry
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=heads // kv_heads >= 4
                )
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            self.wrappers[key] = wrapper
        return wrapper

    def plan(self, meta: StepMetadata) -> FlashInferStep:
        return FlashInferStep(self, meta)

    def graph_step(self, batch_size: int, max_pages: int) -> FlashInferGraphStep:
        return FlashInferGraphStep(self, batch_size, max_pages)
