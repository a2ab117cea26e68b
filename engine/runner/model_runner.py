"""Turns a `SchedulerOutput` into one flat (unpadded) forward and the logits rows to sample.

All per-step metadata (token ids, positions, slot mapping, block tables) is built here once, with
per-sequence (not per-token) Python work, and handed to the attention backend's `plan`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.attention import kv_quant
from engine.attention.base import AttentionBackend, AttentionStep, StepMetadata
from engine.core.batch import GrammarMask, SchedulerOutput
from engine.core.positions import plain_window
from engine.kv.manager import KVCacheManager
from engine.parallel.messages import Step
from engine.parallel.tensor_parallel import TPGroup
from engine.runner.cuda_graphs import CudaGraphs
from engine.runner.encoder import ImageEncoder, StepImages
from engine.runner.pool_memory import pool_zeros
from engine.runner.runner_output import RunnerOutput, pool, sample_step, score_prompts
from engine.runner.step_inputs import step_inputs
from models.llama import LlamaForCausalLM
from models.lora import LoRARows, rows_of
from models.spec import KVGroupSpec

log = logging.getLogger("kvserve.engine")


def allocate_kv_caches(
    backend: type[AttentionBackend],
    groups: list[tuple[int, int]] | list[KVGroupSpec],
    num_blocks: int | list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One tensor per KV group, in the backend's layout, of `num_blocks` blocks (or each
    group's own: the sliding-window layers' pool is smaller); an int8 cache's rows hold their
    scales too (engine/attention/kv_quant.py). A group given as a `KVGroupSpec` (DeepSeek V4's
    compressed groups) is [planes, heads, blocks, entries a block, width]: the torch backend's
    layout, blocks on its `block_dim` (the backends that cannot read them refuse the model)."""
    counts = num_blocks if isinstance(num_blocks, list) else [num_blocks] * len(groups)
    caches = []
    for group, n in zip(groups, counts):
        if isinstance(group, KVGroupSpec):
            e = group.entries_per_block(block_size)
            shape: tuple[int, ...] = (group.planes, group.heads, n, e, group.width)
        else:
            h, d = group
            shape = backend.kv_cache_shape(n, block_size, h, kv_quant.row_width(d, dtype))
        # on CPU out of forked children: they would make each first write a page copy
        cache = (
            pool_zeros(shape, dtype)
            if torch.device(device).type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=device)
        )
        caches.append(cache)
    return caches


class ModelRunner:
    """`aux_layers` (EAGLE-3) makes the forward also return those layers' inputs, for the draft."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv: KVCacheManager,
        device: torch.device,
        aux_layers: tuple[int, ...] = (),
        tp: TPGroup | None = None,
        images: ImageEncoder | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.aux_layers = aux_layers
        self.graphs: CudaGraphs | None = None
        # tensor parallelism: the other ranks run each step's forward on their shards
        self.tp = tp
        self.images = images  # a vision-language model's image encoder and its cache

    def capture_cuda_graphs(
        self, max_num_seqs: int, max_model_len: int, scratch_block: int
    ) -> None:
        """Capture decode steps as CUDA graphs (engine/runner/cuda_graphs.py); a failure leaves the
        runner eager, loudly."""
        graphs = CudaGraphs(
            self.model,
            self.backend,
            self.block_size,
            max_num_seqs,
            max_model_len,
            scratch_block,
            self.aux_layers,
            self.device,
        )
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
        input_ids, positions, meta, rows, _, _ = self._prepare(out, shared_logits=False)
        return input_ids, positions, meta, rows

    def _prepare(
        self, out: SchedulerOutput, shared_logits: bool = True
    ) -> tuple[
        torch.Tensor, torch.Tensor, StepMetadata, list[int], torch.Tensor | None, StepImages | None
    ]:
        """`prepare`, plus the rows as a device index (None when every token samples, as in
        a decode step: no gather needed), all uploaded in one copy, and the step's images
        (their spans are in the metadata too). Under tensor parallelism
        the other ranks are sent the step, and the sampling rows when `shared_logits` (the
        forward then computes their logits by vocabulary part on every rank)."""
        token_ids: list[int] = []
        seqs = []
        window = self.kv.window  # the sliding-window layers' own pool, where reclaimed
        windows: list[list[int]] | None = [] if window is not None else None
        logits_rows: list[int] = []
        for item in out.scheduled:
            r, n = item.request, item.num_new_tokens
            start = r.num_computed_tokens
            token_ids.extend(r.all_token_ids[start : start + n - item.num_spec])
            token_ids.extend(r.spec_token_ids[: item.num_spec])
            seqs.append((self.kv.block_ids(r.request_id), start, n))
            if window is not None and windows is not None:
                windows.append(window.block_ids(r.request_id))
            if item.samples:
                end = len(token_ids)
                logits_rows.extend(range(end - 1 - item.num_spec, end))
        every_row = logits_rows == list(range(len(token_ids)))
        if self.tp is not None:  # both callers run the forward next, which the ranks join
            self.tp.send(Step(seqs, token_ids, logits_rows if shared_logits else []))
        input_ids, positions, meta, index = step_inputs(
            seqs,
            self.block_size,
            self.device,
            token_ids,
            None if every_row else logits_rows,
            windows,
        )
        assert input_ids is not None
        images = self.images.step_images(out) if self.images is not None else None
        if images is not None and any(images.spans):
            meta.image_spans = images.spans
        own = self._rope_positions(out)
        return input_ids, positions if own is None else own, meta, logits_rows, index, images

    def _rope_positions(self, out: SchedulerOutput) -> torch.Tensor | None:
        """[axes, tokens] positions where a scheduled request has its own (M-RoPE with
        images: engine/core/positions.py), the others' token indices on every axis; None
        where none has (the 1-D positions serve)."""
        own = [item.request.rope_positions for item in out.scheduled]
        if all(rope is None for rope in own):
            return None
        axes = next(rope.prompt.shape[0] for rope in own if rope is not None)
        windows = []
        for item, rope in zip(out.scheduled, own):
            start = item.request.num_computed_tokens
            end = start + item.num_new_tokens
            windows.append(
                plain_window(axes, start, end) if rope is None else rope.window(start, end)
            )
        return torch.from_numpy(np.concatenate(windows, axis=1)).to(self.device)

    @torch.inference_mode()
    def all_logits(self, out: SchedulerOutput) -> torch.Tensor:
        """Float32 logits for every scheduled token (prompt scoring), without sampling."""
        input_ids, positions, meta, _, _, images = self._prepare(out, shared_logits=False)
        hidden = self.model(
            input_ids,
            positions,
            self.backend.plan(meta),
            (),
            self._lora(out),
            self._image_rows(images),
        )
        return self.model.compute_logits(hidden)

    @staticmethod
    def _image_rows(images: StepImages | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (images.rows, images.embeds) if images is not None else None

    def execute(self, out: SchedulerOutput, grammar: GrammarMask | None = None) -> RunnerOutput:
        """The step: forward, pool, mask with `grammar`, sample or verify. A failed forward
        fails the batch's requests (in the output); the engine keeps serving."""
        result = RunnerOutput()
        try:
            logits, hidden, result.plan = self.forward(out)
        except Exception:  # noqa: BLE001 - one batch's failure, not the engine's
            if self.tp is not None:
                raise  # the ranks are out of step (or one is gone): nothing can serve on
            log.exception(
                "forward pass failed; failing the %d requests of this batch", len(out.scheduled)
            )
            result.failed = [(s.request, "the forward pass failed") for s in out.scheduled]
            result.forward_failed = True
            return result
        result.hidden = hidden
        width = self.model.spec.hidden_size  # the final-normed state, not EAGLE-3's aux
        pool(hidden, out.scheduled, width, result)
        score_prompts(hidden, out.scheduled, lambda h: self._logits(h[:, :width]), result)
        sample_step(logits, out.scheduled, grammar, result)
        return result

    @torch.inference_mode()
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, AttentionStep] | None]:
        """Run the step's forward. Returns the logits [rows, vocab] (float32) of the rows that
        sample, in scheduled order, every token's hidden state (the draft head's features:
        [tokens, hidden], or [tokens, hidden * (1 + len(aux_layers))]), and the positions and
        plan it ran with (None under a CUDA graph)."""
        input_ids, positions, meta, rows, index, images = self._prepare(out)
        lora = self._lora(out)
        plan = None
        graphed = lora is None and images is None and positions.dim() == 1
        if self.graphs is not None and graphed and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            attn = self.backend.plan(meta)
            plan = (positions, attn)
            hidden = self.model(
                input_ids, positions, attn, self.aux_layers, lora, self._image_rows(images)
            )
        if not rows:
            empty = hidden.new_empty((0, self.model.spec.vocab_size), dtype=torch.float32)
            return empty, hidden, plan
        final = hidden[:, : self.model.spec.hidden_size]
        if index is not None:
            final = final.index_select(0, index)
        logits = self.tp.logits(final) if self.tp is not None else self.model.compute_logits(final)
        return logits, hidden, plan

    def _lora(self, out: SchedulerOutput) -> LoRARows | None:
        """The step's rows of each LoRA adapter (the flat batch's order), None without any."""
        spans, row = [], 0
        for item in out.scheduled:
            if item.request.lora is not None:
                spans.append((item.request.lora, row, item.num_new_tokens))
            row += item.num_new_tokens
        return LoRARows(tuple(rows_of(spans, self.device))) if spans else None  # type: ignore[arg-type]
