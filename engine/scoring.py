"""Prompt scoring: logits for every position of a token sequence, through the same paged path as
serving (blocks allocated, KV written, attention planned), then freed. Used for prompt logprobs
(`echo` in the completions API) and for numerical checks against reference implementations.
Must run on the engine thread, between steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.request import Request
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def score_prompt(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Float32 logits [len(token_ids), vocab]; row i predicts token i + 1."""
    params = SamplingParams(max_tokens=1)
    engine.validate_prompt(token_ids, params)
    request = Request("__score__", list(token_ids), params, frozenset(), engine.max_model_len)
    if not engine.kv.allocate_slots(request, len(token_ids)):
        raise MemoryError("not enough free KV blocks to score this prompt now")
    try:
        return engine.runner.all_logits(
            SchedulerOutput([ScheduledRequest(request, len(token_ids))])
        )
    finally:
        engine.kv.free(request)


def prompt_logprobs(
    engine: LLMEngine, token_ids: list[int], top: int
) -> list[TokenLogprobs | None]:
    """Each prompt token's logprob given the tokens before it, with the `top` most likely
    alternatives; None for the first token, which nothing predicts."""
    if len(token_ids) < 2:
        return [None] * len(token_ids)
    lp = score_prompt(engine, token_ids)[:-1].log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if top > 0:
        values, indices = lp.topk(top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return [None] + [
        TokenLogprobs(t, c, alt) for t, c, alt in zip(token_ids[1:], chosen, tops, strict=True)
    ]
