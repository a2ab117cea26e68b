"""Continuous batching under a per-step token budget.

Each step grants every scheduled request `num_new_tokens` so that `num_computed_tokens` catches up
with `num_tokens`: a prefill chunk, a single decode token, or (later) 1 + k under speculation.
Running requests go first (FCFS among themselves); when the pool runs dry the most recently
admitted running request is preempted by recompute (its blocks freed, its counter reset, and it
returns to the head of the waiting queue). Waiting requests are admitted in arrival order while
budget, `max_num_seqs` and blocks last.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so it yields logits."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


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
    ) -> None:
        self.kv = kv
        self.preempt_by_swap = preempt_by_swap
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management --------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a request from outside the step (abort, stop string): free its blocks now."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        self.kv.free(request)
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

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, n))
                budget -= n
                i += 1

        preempted_now = set(out.preempted)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in preempted_now:
                break  # don't re-admit a victim in the step that evicted it
            hits = self.kv.get_computed_blocks(request)
            num_hit = hits.num_tokens(self.kv.block_size)
            n = min(request.num_tokens - num_hit, budget)
            if not self.kv.allocate_slots(request, n, hits):
                break
            self.waiting.popleft()
            self.kv.record_hit(request, hits)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.num_host_cached_tokens = len(hits.host) * self.kv.block_size
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            budget -= n
        return out

    def _preempt(self, request: Request) -> None:
        if self.preempt_by_swap:
            self.kv.swap_out(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters after the forward, append sampled tokens, finish requests that hit a
        token-level stop. Returns the requests that finished this step (blocks already freed)."""
        finished = []
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.append_token(token)
            if request.check_stop():
                self.finish(request.request_id, request.finish_reason or FinishReason.STOP)
                finished.append(request)
        return finished
