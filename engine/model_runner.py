"""Turns a `SchedulerOutput` into one flat (unpadded) forward and the logits rows to sample.

All per-step metadata (token ids, positions, slot mapping, block tables) is built here once, with
per-sequence (not per-token) Python work, and handed to the attention backend's `plan`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
from engine.cuda_graphs import CudaGraphs
from engine.kv_cache_manager import KVCacheManager
from engine.scheduler import SchedulerOutput
from models.llama import LlamaForCausalLM

log = logging.getLogger("kvserve.engine")


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
    _, positions, meta, _ = step_inputs(seqs, block_size, device)
    return positions, meta


def step_inputs(
    seqs: list[tuple[list[int], int, int]],
    block_size: int,
    device: torch.device,
    token_ids: list[int] | None = None,
    rows: list[int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, StepMetadata, torch.Tensor | None]:
    """`step_metadata` plus the token ids and the logits rows, all uploaded in one host-to-device
    copy (positions, slots, ids and rows are int64 views of one tensor): one transfer per step
    instead of one per tensor. Returns (input ids or None, positions, metadata, rows or None)."""
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
    parts = [*pos_chunks, *slot_chunks]
    if token_ids is not None:
        parts.append(np.asarray(token_ids, dtype=np.int64))
    if rows is not None:
        parts.append(np.asarray(rows, dtype=np.int64))
    flat = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)).to(device)
    positions, slots = flat[:row], flat[row : 2 * row]
    ids = flat[2 * row : 3 * row] if token_ids is not None else None
    rows_t = flat[flat.numel() - len(rows) :] if rows is not None else None
    meta = StepMetadata(query_start, query_lens, context_lens, seq_lens, tables, slots)
    return ids, positions, meta, rows_t


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
        self.graphs: CudaGraphs | None = None

    def capture_cuda_graphs(
        self, max_num_seqs: int, max_model_len: int, scratch_block: int
    ) -> None:
        """Capture decode steps as CUDA graphs (engine/cuda_graphs.py); a failure leaves the
        runner eager, loudly."""
        graphs = CudaGraphs(
            self.model, self.backend, self.block_size, max_num_seqs, max_model_len,
            scratch_block, self.aux_layers, self.device,
        )  # fmt: skip
        try:
            graphs.capture()
        except Exception:  # noqa: BLE001 - eager still serves
            log.exception("CUDA graph capture failed; decode steps stay eager")
            return
        self.graphs = graphs
        log.info("captured CUDA graphs for decode batch sizes %s", list(graphs.sizes))

    def graph_sizes(self) -> tuple[int, ...]:
        return self.graphs.sizes if self.graphs is not None else ()

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int]]:
        """Input ids, positions, attention metadata and the hidden rows that need logits: the
        last row of a chunk that reaches its request's end, and every draft row."""
        input_ids, positions, meta, rows, _ = self._prepare(out)
        return input_ids, positions, meta, rows

    def _prepare(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, StepMetadata, list[int], torch.Tensor | None]:
        """`prepare`, plus the rows as a device index (None when every token samples, as in
        a decode step: no gather needed), all uploaded in one copy."""
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
        every_row = logits_rows == list(range(len(token_ids)))
        input_ids, positions, meta, index = step_inputs(
            seqs, self.block_size, self.device, token_ids, None if every_row else logits_rows
        )
        assert input_ids is not None
        return input_ids, positions, meta, logits_rows, index

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
        input_ids, positions, meta, rows, index = self._prepare(out)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
            self.last_plan = None  # the graph's plan lives in its own buffers
        else:
            attn = self.backend.plan(meta)
            self.last_plan = (positions, attn)
            hidden = self.model(input_ids, positions, attn, self.aux_layers)
        if not rows:
            return hidden.new_empty((0, self.model.spec.vocab_size), dtype=torch.float32), hidden
        final = hidden[:, : self.model.spec.hidden_size]
        if index is not None:
            final = final.index_select(0, index)
        return self.model.compute_logits(final), hidden
