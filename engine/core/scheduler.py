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

The scheduler owns every request's token list and status, and a step has one exit:
`update_from_output` applies the runner's output (counters, tokens, token stops, stop strings
through the output processor's detokenizers, grammar ends, embeddings, failures) and returns
the step's `StepUpdate`. A request finishes only through `finish`, called from there or by an
abort from outside the step.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from engine.core.batch import Emitted, ScheduledRequest, SchedulerOutput, StepUpdate
from engine.core.request import FinishReason, Request, RequestStatus
from engine.kv.manager import KVCacheManager
from engine.runner.runner_output import RunnerOutput

log = logging.getLogger("kvserve.engine")

# A request's new tokens -> (how many to keep, the stop string matched), when a stop string
# ends inside them (the output processor's detokenizers match them on the text)
StopStrings = Callable[[Request, list[int]], "tuple[int, str] | None"]


class Grammars(Protocol):
    def advance(self, request: Request, tokens: list[int]) -> bool:
        """The request's grammar takes its new tokens; True when it has reached its end."""
        ...


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preempt_by_swap: bool = False,
        num_lookahead_tokens: int = 0,
        short_prefill_tokens: int = 0,
        stop_strings: StopStrings | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.kv = kv
        self.stop_strings = stop_strings
        self.grammars = grammars
        self.short_prefill_tokens = short_prefill_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.preempt_by_swap = preempt_by_swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # requests that ended since the last schedule(), and (under a draft head) their block
        # tables before the free
        self.finished_this_step: dict[str, Request] = {}
        self.freed_tables: dict[str, list[int]] = {}
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
            if self.num_lookahead_tokens:  # a draft head catches up into the freed blocks
                self.freed_tables[request_id] = self.kv.block_ids(request_id)
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
        self.freed_tables.clear()

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
                budget += self._unschedule(out, victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n, num_spec))
                budget -= n
                i += 1
        return budget

    @staticmethod
    def _unschedule(out: SchedulerOutput, victim: Request) -> int:
        """Take a preempted request out of this step if an earlier pass scheduled it (a short
        prompt admitted ahead of the running prefills): it holds no blocks now. Returns the
        tokens given back to the budget."""
        for k, item in enumerate(out.scheduled):
            if item.request is victim:
                del out.scheduled[k]
                return item.num_new_tokens
        return 0

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

    def update_from_output(self, out: SchedulerOutput, ran: RunnerOutput) -> StepUpdate:
        """The one exit of a step. Failures end their requests; counters advance and roll back
        over rejected drafts; each sampling request's tokens are appended up to the first
        token stop, cut at a stop string, and taken by its grammar; embedding requests end
        with their prefill. Returns what the step emitted and who finished."""
        update = StepUpdate(out, pooled=ran.pooled, scored=ran.scored)
        for request, why in ran.failed:
            self.finish(request.request_id, FinishReason.ERROR)
            update.failed.append((request, why))
        sampled = {s.request.request_id: res for s, res in ran.sampled}
        for item in out.scheduled:
            request = item.request
            update.first[request.request_id] = request.num_computed_tokens
            request.num_computed_tokens += item.num_new_tokens - item.num_spec
            request.spec_token_ids, request.spec_probs = [], None
            res = sampled.get(request.request_id)
            if res is None or request.is_finished:
                continue
            tokens = self._append(request, res.token_ids)
            tokens = self._cut_at_stop_string(request, tokens, update)
            if tokens is None:
                continue
            if self.grammars is not None and request.matcher is not None:
                if self.grammars.advance(request, tokens) and not request.is_finished:
                    self.finish(request.request_id, FinishReason.STOP)
            logprobs = [lp for lp in res.logprobs[: len(tokens)] if lp is not None]
            kept = len(res.token_ids) - 1  # drafts the verifier accepted
            update.emitted.append(Emitted(request, tokens, logprobs, item.num_spec, kept))
        for request, _ in ran.pooled:
            self.finish(request.request_id, FinishReason.STOP)
        for item in out.scheduled:
            if not item.request.is_finished:
                self.kv.release_behind_window(item.request)
        update.finished = list(self.finished_this_step.values())
        update.tables = dict(self.freed_tables)
        return update

    def _append(self, request: Request, tokens: list[int]) -> list[int]:
        """Append the step's tokens (one, or under speculation the accepted drafts plus the
        target's own) up to the first token stop (the request finishes there)."""
        for j, token in enumerate(tokens):
            if j:  # an accepted draft: its KV (computed in this forward) is kept
                request.num_computed_tokens += 1
            request.append_token(token)
            reason = request.check_stop()
            if reason is not None:
                self.finish(request.request_id, reason)
                return tokens[: j + 1]
        return tokens

    def _cut_at_stop_string(
        self, request: Request, tokens: list[int], update: StepUpdate
    ) -> list[int] | None:
        """The tokens kept once stop strings are matched on their text (what follows a stop
        string was never generated, as far as anyone can tell); None when detokenizing them
        failed (the request fails alone)."""
        if self.stop_strings is None:
            return tokens
        try:
            cut = self.stop_strings(request, tokens)
        except Exception:  # noqa: BLE001 - one request's text, not the engine's
            log.exception("request %s: detokenization failed", request.request_id)
            self.finish(request.request_id, FinishReason.ERROR)
            update.failed.append((request, "detokenization failed"))
            return None
        if cut is None:
            return tokens
        kept, matched = cut
        self.finish(request.request_id, FinishReason.STOP, matched,
                    num_tokens=request.num_tokens - (len(tokens) - kept))  # fmt: skip
        return tokens[:kept]
