"""Decode steps as CUDA graphs, one per batch-size bucket (as vLLM and SGLang capture them).

A decode step's forward is dozens of small kernels per layer; at small batch sizes launching
them costs more than running them. Each bucket B is captured once at startup: static input
buffers (token ids, positions), a backend step over fixed page-table buffers
(`backend.graph_step`, FlashInfer's `use_cuda_graph=True` wrappers) and the model's forward.
A decode step of n <= B sequences copies its inputs into the smallest bucket's buffers, pads
the other B - n rows with a dummy sequence that lives in a scratch block past the pool (one
token, position 0), plans the bucket's wrappers (plan runs on the host, outside the graph) and
replays the graph; rows [0, n) of the bucket's output are the step's hidden states.

Only steps where every sequence decodes one token use graphs; prefill, mixed and speculative
verification steps run eagerly. `--enforce-eager` turns graphs off.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend, StepMetadata
from models.llama import LlamaForCausalLM

log = logging.getLogger("kvserve.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def bucket_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: the standard buckets below max_num_seqs, and max_num_seqs."""
    return tuple(sorted({b for b in BUCKETS if b < max_num_seqs} | {max_num_seqs}))


def pad_metadata(
    meta: StepMetadata, size: int, scratch_block: int, block_size: int
) -> StepMetadata:
    """`meta` (n decode rows) padded to `size` rows with one-token sequences in the scratch
    block."""
    pad = size - meta.num_seqs
    if pad == 0:
        return meta
    slots = meta.slot_mapping
    filler = torch.full((pad,), scratch_block * block_size, dtype=slots.dtype, device=slots.device)
    n = meta.num_seqs
    return StepMetadata(
        meta.query_start + list(range(n, size)),
        meta.query_lens + [1] * pad,
        meta.context_lens + [0] * pad,
        meta.seq_lens + [1] * pad,
        meta.block_tables + [[scratch_block]] * pad,
        torch.cat([slots, filler]),
    )


class _Graph:
    def __init__(self, size: int, step, graph, input_ids, positions, output) -> None:
        self.size, self.step, self.graph = size, step, graph
        self.input_ids, self.positions, self.output = input_ids, positions, output


class CudaGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        scratch_block: int,
        aux_layers: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.block_size, self.scratch_block = block_size, scratch_block
        self.aux_layers, self.device = aux_layers, device
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_pages_per_seq = -(-max_model_len // block_size)
        self.graphs: dict[int, _Graph] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones reuse its memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in sorted(self.sizes, reverse=True):
            step = self.backend.graph_step(size, size * self.max_pages_per_seq)
            input_ids = torch.zeros(size, dtype=torch.long, device=self.device)
            positions = torch.zeros(size, dtype=torch.long, device=self.device)
            empty = StepMetadata([], [], [], [], [], positions[:0])
            step.update(pad_metadata(empty, size, self.scratch_block, self.block_size))
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # one eager run first: lazy inits, autotuning
                self.model(input_ids, positions, step, self.aux_layers)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                output = self.model(input_ids, positions, step, self.aux_layers)
            self.graphs[size] = _Graph(size, step, graph, input_ids, positions, output)
        torch.cuda.synchronize(self.device)

    def can_run(self, meta: StepMetadata) -> bool:
        return (
            bool(self.graphs)
            and meta.num_seqs <= self.sizes[-1]
            and all(q == 1 for q in meta.query_lens)
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """The step's hidden states [n, hidden] (a view of the bucket's output buffer, valid
        until the next replay)."""
        n = meta.num_seqs
        g = self.graphs[next(s for s in self.sizes if s >= n)]
        g.input_ids[:n].copy_(input_ids)
        g.input_ids[n:].zero_()
        g.positions[:n].copy_(positions)
        g.positions[n:].zero_()
        g.step.update(pad_metadata(meta, g.size, self.scratch_block, self.block_size))
        g.graph.replay()
        return g.output[:n]
