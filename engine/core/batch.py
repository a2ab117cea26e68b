"""What a step is made of, as leaf value objects every room may import: the scheduler's grant
(`SchedulerOutput`: each request's `num_new_tokens`) going in, and the step's result once the
scheduler has applied the runner's output (`StepUpdate`) coming out, and the grammar's mask that
goes into the runner beside the grant (`GrammarMask`, with the logits rows it covers). The
output processor and the drafter read a `StepUpdate`; nothing else is handed between them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.request import Request
from engine.core.sampled import TokenLogprobs


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes num_spec draft tokens
    num_spec: int = 0

    @property
    def reaches_end(self) -> bool:
        """True when this chunk reaches the end of the request's tokens."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec == r.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk yields logits: it reaches the end of a generating request."""
        return self.reaches_end and self.request.sampling_params.pooling is None

    @property
    def pools(self) -> bool:
        """True when this chunk ends an embedding request's prefill (engine/runner/pooling.py)."""
        return self.reaches_end and self.request.sampling_params.pooling is not None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # the step budget's tokens the image encoder's work in this step was charged
    encoder_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class Emitted:
    """A sampling request's tokens this step, as kept (after token stops and stop strings),
    with their logprobs; `num_drafted` / `num_accepted`: what verification did with its drafts."""

    request: Request
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    num_drafted: int = 0
    num_accepted: int = 0


@dataclass(slots=True)
class StepUpdate:
    """One step's result, after the scheduler applied it: `first` is each scheduled request's
    `num_computed_tokens` before the step; `emitted`, `pooled` and `scored` what callers are
    told; `failed` the requests that failed alone, with why; `finished` every request that ended
    in the step (whatever ended it), and under a draft head `tables`, their block tables as
    they were before they were freed (the head's catch-up still writes into those blocks)."""

    scheduled: SchedulerOutput
    first: dict[str, int] = field(default_factory=dict)
    emitted: list[Emitted] = field(default_factory=list)
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)
    # (request, first position, prompt logprobs of the tokens after it) per scoring chunk
    scored: list[tuple[Request, int, list[TokenLogprobs]]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    tables: dict[str, list[int]] = field(default_factory=dict)


@dataclass(slots=True)
class GrammarMask:
    """The step's grammar constraint, an input to the runner: `bitmask` row i says what logits
    row `rows[i]` may sample (xgrammar's packed int32 layout)."""

    bitmask: torch.Tensor
    rows: list[int]


def logits_spans(scheduled: list[ScheduledRequest]) -> list[tuple[ScheduledRequest, int, int]]:
    """Each sampling request with its rows [start, end) of the step's logits: one row, plus
    one per draft token."""
    spans, row = [], 0
    for s in scheduled:
        if s.samples:
            spans.append((s, row, row + 1 + s.num_spec))
            row += 1 + s.num_spec
    return spans
