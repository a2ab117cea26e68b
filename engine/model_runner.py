"""Turns a `SchedulerOutput` into one flat (unpadded) forward and the logits rows to sample.

All per-step metadata (token ids, positions, slot mapping, block tables) is built here once, with
per-sequence (not per-token) Python work, and handed to the attention backend's `plan`.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.base import AttentionBackend, StepMetadata
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import SchedulerOutput
from models.llama import LlamaForCausalLM


def allocate_kv_caches(
    backend: type[AttentionBackend],
    groups: list[tuple[int, int]],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per KV group, in the backend's layout."""
    return [
        torch.zeros(
            backend.kv_cache_shape(num_blocks, block_size, h, d), dtype=dtype, device=device
        )
        for h, d in groups
    ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv: KVCacheManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int]]:
        bs = self.block_size
        token_chunks, pos_chunks, slot_chunks = [], [], []
        query_start, query_lens, context_lens, seq_lens, tables = [], [], [], [], []
        logits_rows = []
        row = 0
        for item in out.scheduled:
            r, n = item.request, item.num_new_tokens
            start = r.num_computed_tokens
            table = self.kv.block_ids(r.request_id)
            positions = np.arange(start, start + n)
            table_np = np.asarray(table, dtype=np.int64)
            slot_chunks.append(table_np[positions // bs] * bs + positions % bs)
            token_chunks.append(r.all_token_ids[start : start + n])
            pos_chunks.append(positions)
            query_start.append(row)
            query_lens.append(n)
            context_lens.append(start)
            seq_lens.append(start + n)
            tables.append(table)
            row += n
            if item.samples:
                logits_rows.append(row - 1)
        input_ids = torch.tensor([t for chunk in token_chunks for t in chunk], dtype=torch.long)
        positions = torch.from_numpy(np.concatenate(pos_chunks))
        slots = torch.from_numpy(np.concatenate(slot_chunks))
        meta = StepMetadata(
            query_start, query_lens, context_lens, seq_lens, tables, slots.to(self.device)
        )
        return input_ids.to(self.device), positions.to(self.device), meta, logits_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step's forward; returns logits [num_sampling_requests, vocab] (float32) in the
        order of the scheduled requests that sample."""
        input_ids, positions, meta, rows = self.prepare(out)
        attn = self.backend.plan(meta)
        hidden = self.model(input_ids, positions, attn)
        if not rows:
            return hidden.new_empty((0, self.model.spec.vocab_size), dtype=torch.float32)
        index = torch.tensor(rows, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index))
