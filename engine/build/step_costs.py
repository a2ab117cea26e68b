"""The scheduler's step budget, from step costs measured at startup (engine/core/step_budget.py
says how the budget uses them): one chunk of 1, 4, 16, ... tokens up to the full token budget
or the first slow step, timed on scratch blocks. Kept per process by what it depends on, like
the speculation costs."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.core.step_budget import StepBudget, StepCosts, plausible_step_s, settle_costs
from engine.spec.cost import chunk_step, measured_shape, time_step, timed_rounds
from models.llama import LlamaForCausalLM

log = logging.getLogger("kvserve.engine")

# a row count where kernels switch (1, a few, tens), the efficient chunk's range, and the full
# budget; each timed in interleaved rounds (engine/spec/cost.timed_rounds), the fastest kept
STEP_ROWS = (1, 4, 16, 64, 256)
# steps above the first that takes this long are not measured, their costs extrapolated from
# the two largest measured: on a CPU a chunk's cost per token only grows past a few hundred
# rows (attention grows with the chunk, its activations leave the caches: SmolLM2 on a 2-core
# AVX-512 machine, 256 rows 1.03 ms a token, 1,024 rows 1.22 ms), and timing a 1,024-row step
# twice was 2.5 s of every start there
MEASURE_UP_TO_S = 0.15
# row counts measured whatever they take (the efficient chunk is chosen among them)
ALWAYS_MEASURED = 64
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
    and to streamed decode rows' inter-token latency (`max_itl_factor`)."""
    full = config.max_num_batched_tokens
    if config.target_step_ms < 0:
        return StepBudget(full)
    block_size = backend.block_size
    rows = tuple(sorted({r for r in STEP_ROWS if r < full} | {full}))
    context, rows = measured_shape(rows, False, num_blocks, block_size, context=64)
    key = measurement_key(weights_key, backend, device, context, rows)
    costs = _MEASURED.get(key)
    if costs is None:
        costs = _measure(model, backend, rows, context, block_size, device)
        plausible = plausible_step_s(weight_bytes(model))
        if costs.seconds[0] > plausible:  # starved while timed: once more
            costs = _measure(model, backend, costs.rows, context, block_size, device)
        if costs.seconds[0] > plausible:
            log.warning(
                "step costs not plausible (one row %.0f ms, over this model's roofline floor "
                "of %.0f ms: the CPU was busy while they were timed): every step may take %d "
                "tokens",
                1e3 * costs.seconds[0],
                1e3 * plausible,
                full,
            )
            return StepBudget(full)
        _MEASURED[key] = costs
    factor = config.max_itl_factor
    budget = StepBudget.measured(
        full,
        costs,
        config.target_step_ms,
        max(factor, 0.0),
        block_size,
        config.short_prefill_tokens,
        stream_bound=factor != -1,
    )
    log.info(
        "step budget: %d tokens (%.0f ms) of %d; step costs %s",
        budget.target_rows,
        1000 * (budget.target_s or 0),
        full,
        costs.table(),
    )
    return budget


def _measure(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    rows: tuple[int, ...],
    context: int,
    block_size: int,
    device: torch.device,
) -> StepCosts:
    """The row counts up to the first from ALWAYS_MEASURED whose first step (its warm-up:
    allocations, lazy packing) takes over MEASURE_UP_TO_S, then their timed rounds,
    interleaved, and settled within the roofline (more rows never cheaper, never dearer than
    smaller steps carrying them: `settle_costs`), so a start beside a busy neighbour keeps a
    sane budget."""
    steps = []
    with torch.inference_mode():
        for r in rows:
            steps.append(
                chunk_step(model, backend, r, context, block_size, device, every_logit=False)
            )
            if time_step(steps[-1], device) > MEASURE_UP_TO_S and r >= ALWAYS_MEASURED:
                break
        kept = rows[: len(steps)]
        return StepCosts(kept, settle_costs(kept, timed_rounds(steps, device, warm_up=False)))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a step reads of the model's own tensors (parameters and buffers: packed and
    quantized weights included), for the roofline's floor."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def measurement_key(
    weights_key: tuple, backend: AttentionBackend, device: torch.device, *shape: object
) -> tuple:
    """What a measured step cost depends on, to reuse it across builds in this process: the
    weights, the KV cache's dtype, the backend, the device, the block size, and the `shape`
    measured."""
    kv_dtype = str(backend.kv_caches[0].dtype)
    return (weights_key, kv_dtype, type(backend).__name__, str(device), backend.block_size, *shape)
