"""Which prefills a step serves, in what order, and with how many tokens: the scheduler's policy,
apart from its mechanism (engine/core/scheduler.py grants tokens, allocates blocks, preempts).

A policy sees every request when it arrives (`arrive`: its prefill estimate and its deadline),
every served step's time (`observe_step`), and, each step, the prefills still to serve; it
returns a `PrefillPlan`: the order to serve them in and the step's `StepCaps`, named. The caps
come from the `StepBudget` (engine/core/step_budget.py: target step latency, the streamed rows'
bound), the same for both policies; the order is theirs:

- `DeadlinePolicy` (default): the time-to-first-token deadline each prefill would miss; a short
  prefill (a prefix hit's suffix, a new turn) may take its whole remainder as the step's first.
- `FcfsPolicy`: running prefills in their order (an adapter's rows side by side), then waiting
  requests in arrival order, all within the held cap.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.batch import SchedulerOutput
from engine.core.request import Request, RequestStatus
from engine.core.step_budget import StepBudget


@dataclass(frozen=True, slots=True)
class StepCaps:
    """Prefill tokens one step may give: `held` to a prefill in general (the target step while
    short prompts are near, the streamed rows' bound); `short_room` to the step's first
    prefill when it is short (its whole remainder, for its first token); `total` across every
    prefill of the step (none once it is spent)."""

    held: int
    short_room: int
    total: int


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    order: list[Request]  # running prefills and waiting requests, in the order to serve them
    caps: StepCaps


class PrefillPolicy:
    """What both orders share: deadlines, the short-prefill hold and the served-cost scale."""

    def __init__(self, budget: StepBudget) -> None:
        self.budget = budget
        self.last_short_arrival = float("-inf")
        # steps with prefill chunks: served time over the measured costs' prediction
        self.cost_scale = 1.0

    def arrive(self, request: Request, cached_tokens: int) -> None:
        """A new request, with the prefix cached for it now: its deadline."""
        request.prefill_estimate = max(1, request.num_tokens - cached_tokens)
        request.deadline = self.budget.deadline(request.arrival_time, request.prefill_estimate)
        if self.budget.is_short(request.prefill_estimate):
            self.last_short_arrival = max(self.last_short_arrival, request.arrival_time)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's wall time, against what the measured costs predicted for its tokens (only
        the streamed rows' bound reads it; decode-only steps serve at their measured cost)."""
        predicted = self.budget.predicted(out.num_tokens + out.encoder_tokens)
        if predicted is None or not self.budget.bounds_streams:
            return
        if any(s.num_new_tokens - s.num_spec > 1 for s in out.scheduled):
            self.cost_scale = 0.9 * self.cost_scale + 0.1 * min(seconds / predicted, 10.0)

    def plan(
        self, out: SchedulerOutput, running: list[Request], waiting: list[Request], left: int
    ) -> PrefillPlan:
        """The prefills of a step whose decode rows (`out`) left `left` tokens: `running` the
        running requests not scheduled yet, `waiting` the waiting queue, in its order."""
        raise NotImplementedError

    def caps(
        self, out: SchedulerOutput, pending: list[Request], waiting: list[Request], left: int
    ) -> StepCaps:
        if left <= 0 or not pending:
            return StepCaps(left, left, left)
        budget, now, scale = self.budget, time.monotonic(), self.cost_scale
        decode = budget.max_tokens - left
        streamed = sum(1 for s in out.scheduled if s.request.sampling_params.streamed)
        due = self._prefills_due(out, pending)
        # a short prefill's one step is not cut for the streams: what stalls them is a long
        # prompt's chunks, and a prefix hit's suffix in stream chunks waits steps
        short_room = budget.prefill_tokens(decode, 0, shorts_near=False)
        unheld = budget.prefill_tokens(
            decode, streamed, now=now, prefills=due, shorts_near=False, cost_scale=scale
        )
        held = unheld
        if self._shorts_near(now, waiting, decoding=bool(out.scheduled)):
            held = budget.prefill_tokens(
                decode, streamed, now=now, prefills=due, shorts_near=True, cost_scale=scale
            )
        return StepCaps(min(left, held), min(left, short_room), min(left, unheld))

    def _shorts_near(self, now: float, waiting: list[Request], decoding: bool) -> bool:
        """A short prefill waits, or one arrived within `hold_s` while requests still decode
        (`decoding`: the step has decode rows). With nothing decoding and nothing short
        waiting, a recent short arrival does not hold the step: its client has its answer,
        and a lone long prompt chunked to the target step paid for a newcomer that may never
        come (served TTFT of 1,500 tokens after 256-token prompts: several held steps, each
        reading the weights again)."""
        if any(self.budget.is_short(r.prefill_estimate) for r in waiting):
            return True
        return decoding and now - self.last_short_arrival <= self.budget.hold_s

    def _prefills_due(
        self, out: SchedulerOutput, pending: list[Request]
    ) -> list[tuple[float, int]] | None:
        """(deadline, tokens left) of every prefill not scheduled yet, by deadline; None
        without streamed rows in the step or their bound (nothing asks for it)."""
        if not self.budget.bounds_streams or not any(
            s.request.sampling_params.streamed for s in out.scheduled
        ):
            return None
        return [
            (self.budget.yield_deadline(r.arrival_time, r.deadline), prefill_left(r))
            for r in sorted(pending, key=by_deadline)
        ]


class DeadlinePolicy(PrefillPolicy):
    def plan(
        self, out: SchedulerOutput, running: list[Request], waiting: list[Request], left: int
    ) -> PrefillPlan:
        pending = [*running, *waiting]
        return PrefillPlan(sorted(pending, key=by_deadline), self.caps(out, pending, waiting, left))


class FcfsPolicy(PrefillPolicy):
    def __init__(self, budget: StepBudget, group_adapters: bool = False) -> None:
        super().__init__(budget)
        self.group_adapters = group_adapters

    def plan(
        self, out: SchedulerOutput, running: list[Request], waiting: list[Request], left: int
    ) -> PrefillPlan:
        pending = [*running, *waiting]
        caps = self.caps(out, pending, waiting, left)
        # an adapter's rows side by side (base rows first): each LoRA product then runs on a
        # slice of the step's rows rather than a gather and a scatter (models/lora.py)
        ordered = sorted(running, key=by_adapter) if self.group_adapters else running
        return PrefillPlan([*ordered, *waiting], StepCaps(caps.held, caps.held, caps.held))


def by_adapter(request: Request) -> str:
    lora = request.sampling_params.lora
    return lora.name if lora is not None else ""


def by_deadline(request: Request) -> tuple[float, int, float]:
    """Earliest deadline first; at equal deadlines the less prefill left (a tie under costs
    measured flat), then the earlier arrival."""
    return (request.deadline, prefill_left(request), request.arrival_time)


def prefill_left(request: Request) -> int:
    if request.status == RequestStatus.WAITING:
        return request.prefill_estimate
    return request.num_tokens - request.num_computed_tokens
