"""The scheduler's step budget, from step costs measured at startup (engine/core/step_budget.py
says how the budget uses them): one chunk of 1, 4, 16, ... tokens up to the full token budget,
timed on scratch blocks. Kept per process by what it depends on, like the speculation costs."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.core.step_budget import StepBudget, StepCosts
from engine.spec.cost import chunk_step, measured_shape, median_times
from models.llama import LlamaForCausalLM

log = logging.getLogger("kvserve.engine")

# a row count where kernels switch (1, a few, tens), the efficient chunk's range, and the full
# budget; each measured twice (the faster kept: load on a shared machine only adds time)
STEP_ROWS = (1, 4, 16, 64, 256)
_MEASURED: dict[tuple, StepCosts] = {}


def step_budget(
    config: EngineConfig,
    weights_key: tuple,
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    num_blocks: int,
    device: torch.device,
) -> StepBudget:
    """The budget `config` asks for: the full token budget every step when `target_step_ms`
    is negative (no measurement), else held to the target (0: measured) near short prefills
    and, with `max_itl_factor`, to streamed decode rows' inter-token latency."""
    full = config.max_num_batched_tokens
    if config.target_step_ms < 0:
        return StepBudget(full)
    block_size = backend.block_size
    rows = tuple(sorted({r for r in STEP_ROWS if r < full} | {full}))
    context, rows = measured_shape(rows, False, num_blocks, block_size, context=64)
    key = (weights_key, str(backend.kv_caches[0].dtype), type(backend).__name__, str(device),
           block_size, context, rows)  # fmt: skip
    costs = _MEASURED.get(key)
    if costs is None:
        with torch.inference_mode():
            steps = [chunk_step(model, backend, r, context, block_size, device, every_logit=False)
                     for r in rows]  # fmt: skip
            seconds = median_times(steps, repeats=2, device=device, fastest=True)
        # a noisy sample must not make a longer step look cheaper than a shorter one
        for i in range(1, len(seconds)):
            seconds[i] = max(seconds[i], seconds[i - 1])
        costs = _MEASURED[key] = StepCosts(rows, tuple(seconds))
    budget = StepBudget.measured(full, costs, config.target_step_ms, config.max_itl_factor,
                                 block_size, config.short_prefill_tokens)  # fmt: skip
    log.info(
        "step budget: %d tokens (%.0f ms) of %d; step costs %s",
        budget.target_rows, 1000 * (budget.target_s or 0), full, costs.table(),
    )  # fmt: skip
    return budget
