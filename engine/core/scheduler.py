"""Continuous batching under a per-step token budget.

Each step grants every scheduled request `num_new_tokens` so that `num_computed_tokens` catches up
with `num_tokens`: a prefill chunk, a single decode token, or 1 + k under speculation (the last
token and k draft tokens, verified in one forward; `update` rolls the counter back over rejected
drafts, whose slots are simply overwritten later). With speculation every request that reaches its
end also reserves `num_lookahead_tokens` slots for the draft head's chained steps.
Running requests go first (FCFS among themselves); when the pool runs dry the most recently
admitted running request is preempted by recompute (its blocks freed, its counter reset, and it
returns to the head of the waiting queue). Waiting requests are admitted in arrival order while
budget, `max_num_seqs` and blocks last.

Short prefills first (`short_prefill_tokens` > 0): a step is ordered decodes, then waiting
requests whose uncached remainder is at most that many tokens (a newcomer that hits the prefix
cache needs only its suffix), then running requests' long prefill chunks, then the rest of the
waiting queue. A prefix hit's TTFT then no longer waits behind other requests' long prompts; the
long prefills lose only the tokens the short ones take from one step's budget.

The scheduler owns every request's token list and status: a request finishes only through
`finish` (token stops in `update`, stop strings found by output processing, aborts, failures).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.core.request import FinishReason, Request, RequestStatus
from engine.kv.manager import KVCacheManager


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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preempt_by_swap: bool = False,
        num_lookahead_tokens: int = 0,
        short_prefill_tokens: int = 0,
    ) -> None:
        self.kv = kv
        self.short_prefill_tokens = short_prefill_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.preempt_by_swap = preempt_by_swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # requests that ended since the last schedule(): output processing may still cut them
        self.finished_this_step: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management --------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(
        self,
        request_id: str,
        reason: FinishReason,
        stop_reason: int | str | None = None,
        num_tokens: int | None = None,
    ) -> Request | None:
        """The one way a request ends: its blocks are freed now. `num_tokens` cuts its token
        list there (a stop string matched inside tokens this step emitted: what follows it was
        never generated, as far as anyone can tell). A request finished earlier in the same
        step (by a token stop) may still be cut and get the stop string as its reason."""
        request = self.requests.pop(request_id, None)
        if request is None:
            request = self.finished_this_step.get(request_id)
            if request is None:
                return None
        else:
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.WAITING:
                self.waiting.remove(request)
            request.status = RequestStatus.FINISHED
            self.kv.free(request)
            self.finished_this_step[request_id] = request
        request.finish_reason = reason
        if stop_reason is not None:
            request.stop_reason = stop_reason
        if num_tokens is not None and num_tokens < request.num_tokens:
            del request.all_token_ids[num_tokens:]
            # the draft head's catch-up reads the token after each computed position
            request.num_computed_tokens = min(request.num_computed_tokens, num_tokens - 1)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.kv.begin_step()
        self.finished_this_step.clear()

        if self.short_prefill_tokens > 0:
            budget = self._schedule_running(out, budget, prefills=False)
            budget = self._admit(out, budget, self.short_prefill_tokens)
        budget = self._schedule_running(out, budget, prefills=True)
        self._admit(out, budget, None)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefills: bool) -> int:
        """Schedule running requests not scheduled yet this step: all of them, or (prefills
        False) only those at their end (decodes, verification). Returns the budget left."""
        done = {id(s.request) for s in out.scheduled}
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            if id(request) in done or (not prefills and remaining > 1):
                i += 1
                continue
            n = min(remaining, budget)
            num_spec = 0
            if remaining == 1 and request.spec_token_ids:
                num_spec = min(request.num_spec, budget - 1)
                del request.spec_token_ids[num_spec:]
                if request.spec_probs is not None:
                    request.spec_probs = request.spec_probs[:num_spec] if num_spec else None
                n += num_spec
            lookahead = self._lookahead(request, request.num_computed_tokens, n)
            while not self.kv.allocate_slots(request, n + lookahead):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n, num_spec))
                budget -= n
                i += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, at_most: int | None) -> int:
        """Admit waiting requests in arrival order; with `at_most`, only those whose uncached
        remainder fits in it (the others keep their places). Returns the budget left."""
        preempted_now = set(out.preempted)
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in preempted_now:
                break  # don't re-admit a victim in the step that evicted it
            hits = self.kv.get_computed_blocks(request)
            num_hit = hits.num_tokens(self.kv.block_size)
            if at_most is not None and request.num_tokens - num_hit > at_most:
                skipped.append(self.waiting.popleft())
                continue
            n = min(request.num_tokens - num_hit, budget)
            lookahead = self._lookahead(request, num_hit, n)
            if not self.kv.allocate_slots(request, n + lookahead, hits):
                break
            self.waiting.popleft()
            self.kv.record_hit(request, hits)
            if request.first_scheduled_time is None:  # first admission, not a re-admission
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit
                request.prefix_hit = hits.summary(self.kv.block_size)
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _lookahead(self, request: Request, start: int, n: int) -> int:
        """Slots for the draft head's chain when this chunk reaches the request's end."""
        if not self.num_lookahead_tokens:
            return 0
        ends = start + n - request.num_spec >= request.num_tokens
        return self.num_lookahead_tokens if ends else 0

    def _preempt(self, request: Request) -> None:
        if self.preempt_by_swap:
            self.kv.swap_out(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_probs = [], None
        request.pooled_sum = None  # mean pooling sums again from position 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Advance counters after the forward, append the step's tokens (one, or under
        speculation the accepted drafts plus the target's own token), stop at the first
        token-level stop (the request finishes: its blocks are freed now), and roll
        `num_computed_tokens` back over rejected drafts."""
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens - item.num_spec
            request.spec_token_ids, request.spec_probs = [], None
            tokens = sampled.get(request.request_id)
            if not tokens:
                continue
            for j, token in enumerate(tokens):
                if j:  # an accepted draft: its KV (computed in this forward) is kept
                    request.num_computed_tokens += 1
                request.append_token(token)
                reason = request.check_stop()
                if reason is not None:
                    self.finish(request.request_id, reason)
                    break
