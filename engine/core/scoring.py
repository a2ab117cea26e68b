"""Logits for every position of a token sequence, through the same paged path as serving (blocks
allocated, KV written, attention planned), then freed: the numerical checks against reference
implementations (tests, benchmarks) use it, on an engine nothing else is stepping. Serving scores
prompts through the scheduler instead (`SamplingParams.prompt_logprobs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.batch import ScheduledRequest, SchedulerOutput
from engine.core.images import PromptImage
from engine.core.request import Request
from engine.core.sampling_params import LoRARef, SamplingParams

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine


def score_prompt(
    engine: LLMEngine,
    token_ids: list[int],
    lora: LoRARef | None = None,
    images: tuple[PromptImage, ...] = (),
) -> torch.Tensor:
    """Float32 logits [len(token_ids), vocab]; row i predicts token i + 1. `lora`: the model
    with that adapter; `images`: the prompt's images."""
    params = SamplingParams(max_tokens=1, lora=lora)
    engine.validate_prompt(token_ids, params, images)
    rope = engine.rope_positions(len(token_ids), tuple(images))
    request = Request(
        "__score__",
        list(token_ids),
        params,
        frozenset(),
        engine.max_model_len,
        images=tuple(images),
        rope_positions=rope,
    )
    if lora is not None:
        request.lora = engine.loras.weights(lora)
    if not engine.kv.allocate_slots(request, len(token_ids)):
        raise MemoryError("not enough free KV blocks to score this prompt now")
    try:
        return engine.runner.all_logits(
            SchedulerOutput([ScheduledRequest(request, len(token_ids))])
        )
    finally:
        engine.kv.free(request)
