"""What sampling yields, as plain values every room may read (a leaf: it imports nothing of
the project): a token's logprob with its top alternatives, and a batch's or a verified request's
picks. The sampler (engine/runner/sampler.py) and verification (engine/spec/verify.py) make
them; the core's step results and outputs, and the server's fields, carry them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N alternatives, best first


@dataclass(slots=True)
class SamplerOutput:
    """`token_ids[i]`, `logprobs[i]`: row i's; `refused`: rows where nothing was allowed (a
    grammar that admits no token here, a bias or min_tokens masking every token, NaN after
    processing): their entries in `token_ids` are not tokens and must not be emitted."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    refused: list[int] = field(default_factory=list)
