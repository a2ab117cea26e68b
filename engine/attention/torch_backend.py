"""The CPU backend (named "torch"): the C++ decode and prefill ops, range decode and int8 KV, with
PyTorch paths beside them (the slow general path on GPU). The plain reference: reference_backend.py

KV layout (this backend's choice, base.HEADS_OUTERMOST): one tensor per KV group, [2, kv_heads,
num_blocks, block_size, head_dim]. Heads outermost means gathering a sequence's pages with one
`index_select` over the block dimension yields [kv_heads, pages * block_size, head_dim] directly,
contiguous per head: one copy of the KV per step instead of gather-then-reshape (decode is bound
by reading the KV).

Decode rows (one query token) go to the C++ decode op, or through pool views (range decode), or
in buckets of similar length (gather_paths.py). Prefill chunks are attended one sequence at a
time: on CPU by the C++ prefill op reading the pages in place (kernels/cpu_prefill.cpp);
otherwise with SDPA (gather_paths.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

import engine.attention.cpu_prefill as cpu_prefill
from engine.attention import kv_quant
from engine.attention.base import HEADS_OUTERMOST, AttentionBackend, AttentionStep, StepMetadata
from engine.attention.gather_paths import (
    DecodeBucket,
    PrefillChunk,
    decode_buckets,
    gather_decode,
    gather_prefill,
)
from engine.attention.masks import padded_tables
from engine.attention.matrix import DeviceFacts, ModelNeeds, Verdict, model_refusals, slow_cpu_dtype
from engine.attention.range_decode import RangeDecodePlan
from kernels.ops import CPU_DECODE
from models.attention_step import DecodeStackArgs, PagedBatch
from models.spec import ModelSpec

RANGE_MIN_SEQS = 4  # decode batches at least this large read KV through pool views
CPP_DECODE_DTYPES = (torch.float32, torch.bfloat16)  # query dtypes the C++ ops take
CPP_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)  # KV dtypes they read
# chunks of at most this many rows go through the C++ decode op, a query per row: a verify
# step's 1 + k rows; beyond it each row re-reading the context costs more than one SDPA pass
ROWS_AS_DECODE = 12


def cpp_reads(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the C++ ops take activations of `dtype` on a cache of `cache_dtype`."""
    return dtype in CPP_DECODE_DTYPES and cache_dtype in (dtype, torch.bfloat16, torch.int8)


class TorchAttentionStep(AttentionStep):
    def __init__(self, backend: TorchBackend, meta: StepMetadata) -> None:
        self.backend = backend
        device = backend.kv_caches[0].device
        bs = backend.block_size
        slots = meta.slot_mapping  # on the device already (model_runner.step_inputs)
        if slots.device != device:
            slots = slots.to(device)
        self.slot_block, self.slot_offset = slots // bs, slots % bs

        # a chunk holding image tokens is attended under its own mask (SDPA, below)
        spans = meta.image_spans or [[] for _ in meta.query_lens]
        decode_seqs = [i for i, q in enumerate(meta.query_lens) if q == 1 and not spans[i]]
        # With the C++ decode op, a short chunk (a verify step's 1 + k rows, a short prompt)
        # is attended as one decode query per row, row j seeing its sequence up to its own
        # position: the op writes every row's K/V before it attends, so the rows see each other
        # causally, and the step keeps the fused decode path instead of gather + SDPA.
        cpp = backend.decode_op is not None
        if cpp:
            decode_seqs = [
                i for i, q in enumerate(meta.query_lens) if q <= ROWS_AS_DECODE and not spans[i]
            ]
        rows = [
            (meta.query_start[i] + j, i, meta.context_lens[i] + j + 1)
            for i in decode_seqs
            for j in range(meta.query_lens[i])
        ]
        self.all_decode = len(decode_seqs) == meta.num_seqs
        self.decode_rows = (  # only a mixed step picks its decode rows out (an upload)
            None
            if self.all_decode or not rows
            else torch.tensor([row for row, _, _ in rows], device=device)
        )
        self.range_plan: RangeDecodePlan | None = None
        self.decode: list[DecodeBucket] = []
        self.cpp_decode: tuple[torch.Tensor, torch.Tensor] | None = None  # tables, lengths
        if rows and cpp:
            tables = padded_tables([meta.block_tables[i] for _, i, _ in rows], np.int32)
            lens = np.asarray([length for _, _, length in rows], dtype=np.int32)
            self.cpp_decode = (torch.from_numpy(tables), torch.from_numpy(lens))
        # A few sequences read little KV: the gather path's fewer kernel launches win there.
        elif len(decode_seqs) >= RANGE_MIN_SEQS and backend.use_range_decode and not backend.int8:
            self.range_plan = RangeDecodePlan.build(
                [meta.block_tables[i] for i in decode_seqs],
                [meta.seq_lens[i] for i in decode_seqs],
                bs,
                backend.windows,
                device,
            )
        if decode_seqs and self.range_plan is None and self.cpp_decode is None:
            by_length = sorted(decode_seqs, key=lambda i: meta.seq_lens[i])
            self.decode = decode_buckets(meta, by_length, bs, backend.windows, device)

        self.meta = meta
        self.prefills: list[PrefillChunk] = []
        attended = set(decode_seqs)
        for i, q_len in enumerate(meta.query_lens):
            if i in attended:
                continue
            start, ctx, seq = meta.query_start[i], meta.context_lens[i], meta.seq_lens[i]
            pages = torch.tensor(  # int32: the C++ op's and index_select's
                meta.block_tables[i][: -(-seq // bs)], dtype=torch.int32, device=device
            )
            chunk = PrefillChunk(slice(start, start + q_len), seq, pages, ctx, {}, tuple(spans[i]))
            self.prefills.append(chunk)
        # the sliding-window layers' own pool (engine/kv/window.py): the same plan over its
        # tables, for those layers
        self.window_step: TorchAttentionStep | None = None
        if meta.window_block_tables is None and backend.smallest_cache is not None:
            # a startup forward (warm-up, a judge) on the full pool's ids: within every cache
            top = max((max(t) for t in meta.block_tables if t), default=0)
            if top >= backend.smallest_cache:
                raise ValueError(f"block {top} is past the window pool's {backend.smallest_cache}")
        if meta.window_block_tables is not None:
            window_meta = replace(
                meta,
                block_tables=meta.window_block_tables,
                slot_mapping=meta.window_slot_mapping,
                window_block_tables=None,
                window_slot_mapping=None,
            )
            self.window_step = TorchAttentionStep(backend, window_meta)

    def _step_of(self, layer_idx: int) -> TorchAttentionStep:
        """The plan over the tables layer `layer_idx` reads."""
        if self.window_step is not None and self.backend.layer_window[layer_idx] is not None:
            return self.window_step
        return self

    def attend_qkv(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        decode_only: bool = False,
    ) -> torch.Tensor | None:
        if (step := self._step_of(layer_idx)) is not self:
            return step.attend_qkv(layer_idx, qkv, cos, sin, num_heads, decode_only)
        backend = self.backend
        if (fused := self._fused_decode(cos)) is not None:
            tables, lens = fused
            return backend.rope_decode_op(
                qkv.contiguous(),
                cos,
                sin,
                backend.kv_caches[backend.layer_group[layer_idx]],
                self.slot_block,
                self.slot_offset,
                tables,
                lens,
                num_heads,
                1.0 / math.sqrt(cos.shape[-1] * 2),
                backend.layer_window[layer_idx] or 0,
            )
        if decode_only:
            return None
        q = self.rope_write(layer_idx, qkv, cos, sin, num_heads)
        return None if q is None else self.forward(layer_idx, q, None, None)

    def _fused_decode(self, cos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The C++ block tables and lengths where every row of this step is a decode row for
        the op that fuses rotary (on float32 `cos`/`sin` tables), the KV write and the attention
        (kernels/cpu_decode.cpp); None where the step cannot take it."""
        backend = self.backend
        if not self.all_decode or self.cpp_decode is None or backend.decode_op is None:
            return None  # (tests turn the C++ decode off by clearing decode_op)
        if backend.rope_decode_op is None or cos.dtype != torch.float32:
            return None
        return self.cpp_decode

    def rope_write(
        self,
        layer_idx: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
    ) -> torch.Tensor | None:
        if (step := self._step_of(layer_idx)) is not self:
            return step.rope_write(layer_idx, qkv, cos, sin, num_heads)
        backend = self.backend
        if backend.rope_write_op is None or cos.dtype != torch.float32:
            return None
        cache = backend.kv_caches[backend.layer_group[layer_idx]]
        if not cpp_reads(qkv.dtype, cache.dtype):
            return None
        return backend.rope_write_op(
            qkv.contiguous(), cos, sin, cache, self.slot_block, self.slot_offset, num_heads
        )

    def paged_batch(self) -> PagedBatch:
        m = self.meta
        return PagedBatch(
            self.backend.kv_caches,
            self.backend.block_size,
            m.query_start,
            m.query_lens,
            m.context_lens,
            m.block_tables,
            m.window_block_tables,
        )

    def decode_stack_args(self, cos: torch.Tensor, num_layers: int) -> DecodeStackArgs | None:
        if self.window_step is not None:  # one set of tables for the op: every layer windowed
            windowed = all(w is not None for w in self.backend.layer_window[:num_layers])
            return self.window_step.decode_stack_args(cos, num_layers) if windowed else None
        backend = self.backend
        if (fused := self._fused_decode(cos)) is None or len(backend.windows) > 1:
            return None  # (the stack op takes one window for every layer)
        tables, lens = fused
        return DecodeStackArgs(
            [backend.kv_caches[backend.layer_group[i]] for i in range(num_layers)],
            self.slot_block,
            self.slot_offset,
            tables,
            lens,
            1.0 / math.sqrt(cos.shape[-1] * 2),
            backend.layer_window[0] or 0,
        )

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        if (step := self._step_of(layer_idx)) is not self:
            return step.forward(layer_idx, q, k, v)
        backend = self.backend
        cache = backend.kv_caches[backend.layer_group[layer_idx]]
        cache = kv_quant.write_kv(cache, self.slot_block, self.slot_offset, k, v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        window = backend.layer_window[layer_idx]
        if self.cpp_decode is not None:
            assert self.backend.decode_op is not None
            tables, lens = self.cpp_decode
            qd = q.contiguous() if self.all_decode else q.index_select(0, self.decode_rows)
            od = self.backend.decode_op(qd, cache[0], cache[1], tables, lens, scale, window or 0)
            if self.all_decode:
                return od
            out = q.new_empty(q.shape)
            out.index_copy_(0, self.decode_rows, od)
        elif self.range_plan is not None:
            if self.all_decode:
                return self.range_plan.attend(q, cache, scale, window)
            out = q.new_empty(q.shape)
            qd = q.index_select(0, self.decode_rows)
            attended = self.range_plan.attend(qd, cache, scale, window)
            out.index_copy_(0, self.decode_rows, attended)
        else:
            out = q.new_empty(q.shape)
        for bucket in self.decode:
            o = gather_decode(bucket, q.index_select(0, bucket.rows), cache, scale, window)
            out.index_copy_(0, bucket.rows, o)
        op_takes = self.backend.prefill_op is not None and cpp_reads(q.dtype, cache.dtype)
        # Gemma 4's images attend both ways on its sliding-window layers only
        two_way = window is not None or not backend.spans_windowed_only
        for p in self.prefills:
            if op_takes and not (two_way and p.image_spans):  # reads the pages (causal only)
                o = out[p.rows]
                self.backend.prefill_op(
                    q[p.rows], o, cache[0], cache[1], p.pages, p.context, scale, window or 0
                )
                continue
            fresh = (k[p.rows], v[p.rows]) if k is not None and v is not None else None
            out[p.rows] = gather_prefill(p, q[p.rows], fresh, cache, scale, window, two_way)
        return out


class TorchBackend(AttentionBackend):
    name = "torch"
    kv_layout = HEADS_OUTERMOST
    reads_window_tables = True
    use_range_decode = True  # False forces the gather path (tests compare the two)

    def __init__(
        self,
        spec: ModelSpec,
        kv_caches: list[torch.Tensor],
        block_size: int,
        workspace: torch.Tensor | None = None,
    ) -> None:
        super().__init__(spec, kv_caches, block_size, workspace)
        sizes = {cache.shape[self.block_dim] for cache in kv_caches}
        # the sliding-window layers' pool, where smaller than the others (engine/kv/window.py)
        self.smallest_cache = min(sizes) if len(sizes) > 1 else None
        self.int8 = kv_caches[0].dtype == torch.int8  # the range plan reads raw pool views
        self.spans_windowed_only = spec.vision is not None and spec.vision.two_way_windowed_only
        # Decode rows go to the compiled C++ op where it builds (CPU, float32 or bfloat16 KV,
        # float32 arithmetic); None: PyTorch ops (range plan or gather buckets; float16 on
        # CPU). Tests set it to None to compare the paths.
        self.decode_op = None
        self.rope_decode_op = None  # the same op with rotary and the KV write fused in front
        self.rope_write_op = None  # rotary and the KV write alone (any step; tests clear it)
        # Prefill chunks go to the compiled C++ prefill op where every layer's head size is a
        # multiple of its vector width; None: SDPA (tests compare them).
        self.prefill_op = None
        if kv_caches[0].device.type == "cpu" and kv_caches[0].dtype in CPP_CACHE_DTYPES:
            ops = CPU_DECODE.load()
            if ops is not None:
                self.decode_op, self.rope_decode_op = ops.paged_decode, ops.rope_write_decode
                self.rope_write_op = ops.rope_write
            prefill = cpu_prefill.load()
            if prefill is not None and all(
                lay.head_dim % prefill.simd_width() == 0 for lay in spec.layers
            ):
                self.prefill_op = prefill.paged_prefill

    @classmethod
    def check(
        cls, needs: ModelNeeds, facts: DeviceFacts, dtype: torch.dtype, block_size: int
    ) -> Verdict:
        verdict = slow_cpu_dtype(facts, dtype)
        if needs.compressed and needs.int8_kv:
            verdict["int8 KV"] = "compressed KV groups are stored in the serving dtype"
        return verdict | model_refusals(
            needs, soft_cap=False, int8_kv=True, compressed=True, image_spans=True
        )

    @classmethod
    def is_fast_on(cls, facts: DeviceFacts) -> bool:
        return facts.type == "cpu"  # on a GPU, gather + SDPA is the slow general path

    def plan(self, meta: StepMetadata) -> TorchAttentionStep:
        return TorchAttentionStep(self, meta)
