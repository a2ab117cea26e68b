"""What the engine hands back per request per step: deltas, never the whole history."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.sampled import TokenLogprobs


class ClientFault(str):
    """Why a request failed, when its own inputs caused it (constraints that leave no token to
    pick): the server answers the client's error (4xx), not its own (5xx)."""


@dataclass(frozen=True, slots=True)
class PrefixSummary:
    """Where a request's prompt was found when it was first admitted, in tokens per tier, and
    how many tokens right after that were cached once and evicted since (a miss the cache's
    size caused, not the prompt)."""

    device: int = 0
    host: int = 0
    disk: int = 0
    remote: int = 0
    evicted: int = 0

    @property
    def cached(self) -> int:
        return self.device + self.host + self.disk + self.remote


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prefix_hit: PrefixSummary | None = None  # once admitted
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None
    client_error: bool = False  # `error` is the request's own fault (a ClientFault)
    queue_time: float | None = None  # seconds from arrival to first scheduling
    prefill_time: float | None = None  # seconds from first scheduling to first token
    # with `prompt_logprobs`: each prompt token's logprob (None for the first), in the output
    # that ends the prefill
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # an embedding request's result: the pooled, L2-normalised hidden state (float32, CPU)
    embedding: torch.Tensor | None = None
    # a finished request with `export_kv`: its prompt's cached full blocks as (hash, bytes),
    # taken in the step that finished it (no later call has to wait for the engine thread)
    kv_blocks: list[tuple[bytes, bytes]] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """Accumulated result of one finished request (the offline `LLM` API)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
