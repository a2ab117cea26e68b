"""Prompt scoring: logits for every position of a token sequence, through the same paged path as
serving (blocks allocated, KV written, attention planned), then freed. Used for prompt logprobs
(`echo` in the completions API) and for numerical checks against reference implementations.
Must run on the engine thread, between steps."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput


def score_prompt(engine, token_ids: list[int]) -> torch.Tensor:  # engine: LLMEngine
    """Float32 logits [len(token_ids), vocab]; row i predicts token i + 1."""
    params = SamplingParams(max_tokens=1)
    engine.validate_prompt(token_ids, params)
    request = Request("__score__", list(token_ids), params, frozenset(), engine.max_model_len)
    if not engine.kv.allocate_slots(request, len(token_ids)):
        raise MemoryError("not enough free KV blocks to score this prompt now")
    try:
        batch = SchedulerOutput([ScheduledRequest(request, len(token_ids))])
        input_ids, positions, meta, _ = engine.runner.prepare(batch)
        with torch.inference_mode():
            hidden = engine.model(input_ids, positions, engine.runner.backend.plan(meta))
            return engine.model.compute_logits(hidden)
    finally:
        engine.kv.free(request)
