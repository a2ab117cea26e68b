"""Continuous batching under a per-step token budget.

Each step grants every scheduled request `num_new_tokens` so that `num_computed_tokens` catches up
with `num_tokens`: a prefill chunk, a single decode token, or 1 + k under speculation (the last
token and k draft tokens, verified in one forward; `update` rolls the counter back over rejected
drafts, whose slots are simply overwritten later). With speculation every request that reaches its
end also reserves `num_lookahead_tokens` slots for the draft head's chained steps.

This module is the mechanism (vLLM v1's): a step first takes every running request at its end
(decodes, verification), then serves prefills (running requests' next chunks and newly admitted
prompts) in the order and within the caps that the `PrefillPolicy` plans for the step
(engine/core/prefill_policy.py: `deadline` or `fcfs`, over the `StepBudget`'s target latency
and streamed-row bound), in one admission loop. When the pool runs dry the most recently
admitted running request is preempted by recompute (its blocks freed, its counter reset, and it
returns to the head of the waiting queue). Waiting requests are admitted while the caps,
`max_num_seqs` and blocks last; the first that cannot join (no slot, no blocks, preempted in
this very step) stops admission: nothing behind it in the policy's order skips ahead.

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
from engine.core.images import cut_at_image, encoder_charge
from engine.core.prefill_policy import (
    DeadlinePolicy,
    FcfsPolicy,
    PrefillPlan,
    PrefillPolicy,
    by_adapter,
    prefill_left,
)
from engine.core.request import FinishReason, Request, RequestStatus
from engine.core.step_budget import StepBudget
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
        budget: StepBudget,
        preempt_by_swap: bool = False,
        num_lookahead_tokens: int = 0,
        by_deadline: bool = True,
        stop_strings: StopStrings | None = None,
        grammars: Grammars | None = None,
        max_loras: int = 0,
        image_cost: float = 0.0,
    ) -> None:
        """`image_cost`: the prefill tokens one image soft token's encoding is worth in a step
        (0: images cost only their positions)."""
        self.kv = kv
        self.image_cost = image_cost
        self.max_loras = max_loras
        self.stop_strings = stop_strings
        self.grammars = grammars
        self.num_lookahead_tokens = num_lookahead_tokens
        self.preempt_by_swap = preempt_by_swap
        self.max_num_seqs = max_num_seqs
        self.budget = budget
        # the order prefills are served in and the step's caps (engine/core/prefill_policy.py)
        self.policy: PrefillPolicy = (
            DeadlinePolicy(budget) if by_deadline else FcfsPolicy(budget, bool(max_loras))
        )
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
        # the deadline from the prefix cached now (a device or host lookup, no loading)
        cached = 0
        if self.kv.enable_caching:
            self.kv.update_block_hashes(request)
            cached = self.kv.num_cached_prefix(request.block_hashes) * self.kv.block_size
        self.policy.arrive(request, cached)
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
        self.kv.begin_step()
        self.finished_this_step.clear()
        self.freed_tables.clear()
        left = self._schedule_decodes(out, self.budget.max_tokens)
        done = {id(s.request) for s in out.scheduled}
        running = [r for r in self.running if id(r) not in done]
        self._schedule_prefills(out, self.policy.plan(out, running, list(self.waiting), left))
        return out

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        self.policy.observe_step(out, seconds)

    def _schedule_prefills(self, out: SchedulerOutput, plan: PrefillPlan) -> None:
        """The one admission loop: running requests' next chunks and waiting requests'
        admissions, in the policy's order, within its caps: `held` each, but for the first
        short one (its whole remainder in one step, for its first token) `short_room`; none
        once `total` is spent. Admission stops at the first waiting request that cannot join
        (no sequence slot, no blocks, preempted in this very step: nothing behind it skips
        ahead); running requests behind it still get their chunks."""
        held, total = plan.caps.held, plan.caps.total
        preempted_now = set(out.preempted)
        admitting = True
        for request in plan.order:
            if total <= 0:
                break
            # a short prefill takes its whole remainder, beyond the held room only as the
            # step's first prefill: shorts that arrived together go one step each, shortest
            # deadline first, rather than all waiting for one long step
            first = total == plan.caps.total
            short = self.budget.is_short(prefill_left(request))
            cap = min(plan.caps.short_room if short and first else held, total)
            if cap <= 0:
                continue
            if request.status == RequestStatus.RUNNING and request in self.running:
                left = self._schedule_one(out, request, cap)
            elif request.status == RequestStatus.WAITING and admitting:
                if not self._lora_admissible(request):
                    continue
                joins = (
                    request.request_id not in preempted_now
                    and len(self.running) < self.max_num_seqs
                )
                admitted = self._admit_one(out, request, cap) if joins else None
                if admitted is None:
                    admitting = False
                    continue
                left = admitted
            else:
                continue
            held, total = held - (cap - left), total - (cap - left)

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the running requests at their end (decodes, verification), in their order.
        Returns the budget left."""
        # an adapter's rows side by side (base rows first): each LoRA product then runs on a
        # slice of the step's rows rather than a gather and a scatter (models/lora.py)
        order = sorted(self.running, key=by_adapter) if self.max_loras else list(self.running)
        for request in order:
            if budget <= 0:
                break
            remaining = request.num_tokens - request.num_computed_tokens
            if request in self.running and remaining <= 1:  # not preempted by an earlier one
                budget = self._schedule_one(out, request, budget)
        return budget

    def _schedule_one(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        """Grant a running request its next tokens (a chunk, a decode token, or 1 + drafts),
        preempting the newest running requests while its blocks do not fit (it may be the
        victim itself). Returns the budget left."""
        remaining = request.num_tokens - request.num_computed_tokens
        n = min(remaining, budget)
        if request.images:  # no chunk ends inside an image (engine/core/images.py)
            n = cut_at_image(request.images, request.num_computed_tokens, n)
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
                return budget
        out.scheduled.append(ScheduledRequest(request, n, num_spec))
        return budget - n - self._image_charge(out, request, request.num_computed_tokens, n)

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

    def _admit_one(self, out: SchedulerOutput, request: Request, budget: int) -> int | None:
        """Admit one waiting request with its prefix hit and first chunk; None (and no change)
        when the pool cannot supply its blocks. Returns the budget left."""
        hits = self.kv.get_computed_blocks(request)
        num_hit = hits.num_tokens(self.kv.block_size)
        n = min(request.num_tokens - num_hit, budget)
        if request.images:
            n = cut_at_image(request.images, num_hit, n)
        lookahead = self._lookahead(request, num_hit, n)
        if not self.kv.allocate_slots(request, n + lookahead, hits):
            return None
        self.waiting.remove(request)
        self.kv.record_hit(request, hits)
        if request.first_scheduled_time is None:  # first admission, not a re-admission
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_hit
            request.prefix_hit = hits.summary(self.kv.block_size)
        request.num_computed_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, n))
        return budget - n - self._image_charge(out, request, num_hit, n, admitted=True)

    def _image_charge(
        self, out: SchedulerOutput, request: Request, start: int, n: int, admitted: bool = False
    ) -> int:
        """What the encoder's work on the images in this chunk takes of the step's budget."""
        if not request.images:
            return 0
        charge = encoder_charge(request.images, start, n, self.image_cost, admitted)
        out.encoder_tokens += charge
        return charge

    def _lora_admissible(self, request: Request) -> bool:
        """A request of an adapter no running request uses joins only while fewer than
        `max_loras` adapters run, so that no step holds rows of more."""
        lora = request.sampling_params.lora
        if lora is None:
            return True
        running = {r.sampling_params.lora.name for r in self.running if r.sampling_params.lora}
        return lora.name in running or len(running) < self.max_loras

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
            self.kv.forget_unwritten(request)
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
        self.finish(
            request.request_id,
            FinishReason.STOP,
            matched,
            num_tokens=request.num_tokens - (len(tokens) - kept),
        )
        return tokens[:kept]
