"""FlashInfer paged attention (CUDA only; the `gpu` extra). Written against FlashInfer's documented
wrapper API (BatchDecodeWithPagedKVCacheWrapper / BatchPrefillWithPagedKVCacheWrapper, plan then
run); exercised by tests/test_gpu.py where a GPU is lent.

KV layout: FlashInfer's NHD pages, one tensor per KV group [num_blocks, 2, block_size, kv_heads,
head_dim]. Per step: one plan per distinct layer geometry (query heads, KV heads, head_dim), with
the decode wrapper when every sequence decodes one token and the prefill wrapper (causal, which
also serves 1-token rows) otherwise. New K/V are written by slot before each layer attends.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict, dtype_name
from models.spec import ModelSpec

HEAD_DIMS = (64, 128, 256)
PAGE_SIZES = (16, 32, 64)
WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferStep(AttentionStep):
    def __init__(self, backend: FlashInferBackend, meta: StepMetadata) -> None:
        import flashinfer

        self.backend = backend
        device = backend.kv_caches[0].device
        bs = backend.block_size
        pages = [-(-n // bs) for n in meta.seq_lens]
        indices = [b for table, n in zip(meta.block_tables, pages) for b in table[:n]]
        as_i32 = {"dtype": torch.int32, "device": device}
        kv_indptr = torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], **as_i32)
        kv_indices = torch.tensor(indices, **as_i32)
        last_len = torch.tensor([n - (p - 1) * bs for n, p in zip(meta.seq_lens, pages)], **as_i32)
        slots = meta.slot_mapping.to(device)
        self.slot_block, self.slot_offset = slots // bs, slots % bs
        decode_only = all(q == 1 for q in meta.query_lens)
        qo_indptr = torch.tensor([*meta.query_start, sum(meta.query_lens)], **as_i32)
        spec, dtype = backend.spec, backend.kv_caches[0].dtype
        window = spec.sliding_window - 1 if spec.sliding_window else -1
        soft_cap = spec.extra.get("attn_logit_softcapping")
        self.wrappers: dict[tuple[int, int, int], object] = {}
        for geometry in backend.geometries:
            heads, kv_heads, head_dim = geometry
            workspace = backend.workspace(geometry)
            if decode_only:
                wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    workspace, "NHD", use_tensor_cores=heads // kv_heads >= 4
                )
                wrapper.plan(
                    kv_indptr, kv_indices, last_len, heads, kv_heads, head_dim, bs,
                    window_left=window, logits_soft_cap=soft_cap,
                    q_data_type=dtype, kv_data_type=dtype,
                )  # fmt: skip
            else:
                wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
                wrapper.plan(
                    qo_indptr, kv_indptr, kv_indices, last_len, heads, kv_heads, head_dim, bs,
                    causal=True, window_left=window, logits_soft_cap=soft_cap,
                    q_data_type=dtype, kv_data_type=dtype,
                )  # fmt: skip
            self.wrappers[geometry] = wrapper

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        backend = self.backend
        cache = backend.kv_caches[backend.layer_group[layer_idx]]
        if k is not None and v is not None:  # None: a layer reading a shared KV group
            cache[self.slot_block, 0, self.slot_offset] = k
            cache[self.slot_block, 1, self.slot_offset] = v
        return self.wrappers[backend.layer_geometry[layer_idx]].run(q.contiguous(), cache)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    block_dim = 0
    slot_dim = 2

    @classmethod
    def kv_cache_shape(
        cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (num_blocks, 2, block_size, kv_heads, head_dim)

    @classmethod
    def check(
        cls, needs: ModelNeeds, facts: DeviceFacts, dtype: torch.dtype, block_size: int
    ) -> Verdict:
        verdict: Verdict = {}
        if facts.type != "cuda":
            verdict["device"] = "needs a CUDA GPU"
        elif "flashinfer" not in facts.libraries:
            verdict["device"] = "flashinfer is not installed (pip install .[gpu])"
        if facts.capability is not None and facts.capability < (7, 5):
            verdict["compute capability"] = f"sm{facts.capability[0]}{facts.capability[1]} < sm75"
        if dtype not in (torch.float16, torch.bfloat16):
            verdict["dtype"] = f"{dtype_name(dtype)}: kernels are built for float16/bfloat16"
        elif dtype == torch.bfloat16 and facts.capability is not None and facts.capability < (8, 0):
            verdict["dtype"] = "bfloat16 needs sm80+"
        bad_dims = [d for d in needs.head_dims if d not in HEAD_DIMS]
        if bad_dims:
            verdict["head_dim"] = f"head_dim {bad_dims} not in {HEAD_DIMS}"
        if needs.uneven_gqa:
            verdict["GQA group size"] = "query heads not a multiple of KV heads"
        if block_size not in PAGE_SIZES:
            verdict["block size"] = f"page size {block_size} not in {PAGE_SIZES}"
        if needs.tree_masks:
            verdict["tree masks"] = "custom masks are prefill-only; not wired here"
        return verdict

    def __init__(self, spec: ModelSpec, kv_caches: list[torch.Tensor], block_size: int) -> None:
        super().__init__(spec, kv_caches, block_size)
        self.layer_geometry = [
            (lay.num_heads, lay.num_kv_heads, lay.head_dim) for lay in spec.layers
        ]
        self.geometries = sorted(set(self.layer_geometry))
        self._workspaces: dict[tuple[int, int, int], torch.Tensor] = {}

    def workspace(self, geometry: tuple[int, int, int]) -> torch.Tensor:
        """One workspace per geometry: a plan lives in its wrapper's workspace until run."""
        if geometry not in self._workspaces:
            device = self.kv_caches[0].device
            self._workspaces[geometry] = torch.empty(
                WORKSPACE_BYTES, dtype=torch.uint8, device=device
            )
        return self._workspaces[geometry]

    def plan(self, meta: StepMetadata) -> FlashInferStep:
        return FlashInferStep(self, meta)
