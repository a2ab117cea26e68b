"""Turns a `SchedulerOutput` into one flat (unpadded) forward and the logits rows to sample.

All per-step metadata (token ids, positions, slot mapping, block tables) is built here once, with
per-sequence (not per-token) Python work, and handed to the attention backend's `plan`.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
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


def step_metadata(
    seqs: list[tuple[list[int], int, int]], block_size: int, device: torch.device
) -> tuple[torch.Tensor, StepMetadata]:
    """Positions and attention metadata for a flat batch of (block table, first position, number
    of tokens) per sequence: per-sequence numpy work, nothing per token in Python."""
    pos_chunks, slot_chunks = [], []
    query_start, query_lens, context_lens, seq_lens, tables = [], [], [], [], []
    row = 0
    for table, start, n in seqs:
        positions = np.arange(start, start + n)
        table_np = np.asarray(table, dtype=np.int64)
        slot_chunks.append(table_np[positions // block_size] * block_size + positions % block_size)
        pos_chunks.append(positions)
        query_start.append(row)
        query_lens.append(n)
        context_lens.append(start)
        seq_lens.append(start + n)
        tables.append(table)
        row += n
    positions = torch.from_numpy(np.concatenate(pos_chunks)).to(device)
    slots = torch.from_numpy(np.concatenate(slot_chunks)).to(device)
    return positions, StepMetadata(query_start, query_lens, context_lens, seq_lens, tables, slots)


class ModelRunner:
    """`aux_layers` (EAGLE-3) makes the forward also return those layers' inputs, for the draft."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv: KVCacheManager,
        device: torch.device,
        aux_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.aux_layers = aux_layers
        # The last step's positions and attention plan: the draft head's catch-up reuses them
        # when it covers exactly the step's tokens (no rejected drafts), saving a second plan.
        self.last_plan: tuple[torch.Tensor, AttentionStep] | None = None

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int]]:
        """Input ids, positions, attention metadata and the hidden rows that need logits: the
        last row of a chunk that reaches its request's end, and every draft row."""
        token_ids: list[int] = []
        seqs = []
        logits_rows: list[int] = []
        for item in out.scheduled:
            r, n = item.request, item.num_new_tokens
            start = r.num_computed_tokens
            token_ids.extend(r.all_token_ids[start : start + n - item.num_spec])
            token_ids.extend(r.spec_token_ids[: item.num_spec])
            seqs.append((self.kv.block_ids(r.request_id), start, n))
            if item.samples:
                end = len(token_ids)
                logits_rows.extend(range(end - 1 - item.num_spec, end))
        positions, meta = step_metadata(seqs, self.block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return input_ids, positions, meta, logits_rows

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Float32 logits for every scheduled token (prompt scoring), without sampling."""
        input_ids, positions, meta, _ = self.prepare(out)
        hidden = self.model(input_ids, positions, self.backend.plan(meta))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step's forward. Returns the logits [rows, vocab] (float32) of the rows that
        sample, in scheduled order, and every token's hidden state (the draft head's features:
        [tokens, hidden], or [tokens, hidden * (1 + len(aux_layers))])."""
        input_ids, positions, meta, rows = self.prepare(out)
        attn = self.backend.plan(meta)
        self.last_plan = (positions, attn)
        hidden = self.model(input_ids, positions, attn, self.aux_layers)
        if not rows:
            return hidden.new_empty((0, self.model.spec.vocab_size), dtype=torch.float32), hidden
        index = torch.tensor(rows, device=hidden.device)
        final = hidden[:, : self.model.spec.hidden_size]
        return self.model.compute_logits(final.index_select(0, index)), hidden
