"""The synchronous engine: adds, aborts and steps requests. One step is
schedule -> execute (forward, pool, sample: engine/runner/model_runner.py) -> update -> outputs ->
propose. Building lives in `engine/build/builder.py`, text and stop strings in
`engine/core/output_processor.py`. Single-threaded by design; `AsyncEngine` drives it from its
own thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.build.builder import build_engine
from engine.config import EngineConfig
from engine.core.engine_info import EngineInfo
from engine.core.output_processor import OutputProcessor
from engine.core.outputs import RequestOutput
from engine.core.request import FinishReason, Request
from engine.core.sampling_params import ParamError, SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.core.snapshot import EngineSnapshot, HostTierSnapshot, SpecSnapshot
from engine.kv.host import SWAP_IN_BUCKETS
from engine.kv.manager import KVCacheManager
from engine.runner.runner_output import RunnerOutput
from engine.spec.eagle import CatchUp, record_acceptance

log = logging.getLogger("kvserve.engine")


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self.config = config
        self.info: EngineInfo = parts.info
        self.model, self.spec, self.draft = parts.model, parts.spec, parts.draft
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.host, self.kv, self.scheduler = parts.host, parts.kv, parts.scheduler
        self.runner, self.proposer, self.drafter = parts.runner, parts.proposer, parts.drafter
        self.structured = parts.structured
        self.tp = parts.tp
        self.outputs = OutputProcessor(parts.tokenizer, parts.scheduler, parts.kv.export_prompt)
        self.stats = EngineStats()

    @property
    def num_blocks(self) -> int:
        return self.info.num_blocks

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    # ---- requests ----------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.info.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        validated: bool = False,
    ) -> Request:
        """`validated`: the caller (AsyncEngine.submit) has already run `info.validate`."""
        if not validated:
            self.info.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id}")
        request = Request(
            request_id, list(prompt_token_ids), params, self.eos_token_ids, self.max_model_len,
            device=self.runner.device,  # seeded generators draw on the engine's device
        )  # fmt: skip
        if params.grammar is not None:
            if self.structured is None:
                raise ParamError(
                    "response_format", "structured outputs are not available on this server"
                )
            request.matcher = self.structured.matcher(params.grammar)
        self.scheduler.add(request)
        self.outputs.add(request)
        return request

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        request = self.scheduler.finish(request_id, reason)
        return self.outputs.final_output(request) if request is not None else None

    def abort_all(self) -> list[str]:
        """End every request (shutdown, engine failure); returns their ids."""
        ids = list(self.scheduler.requests)
        for request_id in ids:
            self.abort_request(request_id)
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def offload_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Move an idle session's cached blocks to the host tier; returns blocks moved."""
        return self.kv.offload_prefix(token_ids, cache_salt)

    def import_blocks(self, blocks: list[tuple[bytes, bytes]]) -> int:
        """Blocks fetched from the remote store into the host tier; returns how many."""
        return self.kv.import_blocks(blocks)

    def snapshot(self) -> EngineSnapshot:
        """Plain data for stats, metrics and the page (engine/core/snapshot.py); a pure read."""
        kv, sched, pool = self.kv, self.scheduler, self.kv.pool
        host = None
        if self.host is not None:
            h = self.host
            host = HostTierSnapshot(
                h.used_bytes, h.capacity_bytes, h.block_bytes, h.saved_blocks, h.loaded_blocks,
                h.evicted_blocks, SWAP_IN_BUCKETS, tuple(h.load_latency_counts), h.load_seconds,
            )  # fmt: skip
        spec = None
        if self.drafter is not None:
            s = self.drafter.total_stats()
            by_source = {
                name: (st.num_draft_tokens, st.num_accepted_tokens)
                for name, st in self.drafter.stats.items()
            }
            spec = SpecSnapshot(
                s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                s.mean_acceptance_length, self.drafter.current_k, list(s.accepted_per_position),
                by_source,
            )  # fmt: skip
        return EngineSnapshot(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_preemptions=sched.num_preemptions,
            kv_usage=pool.usage,
            num_blocks=pool.num_blocks,
            block_size=kv.block_size,
            block_map="".join(
                "2" if b.ref_cnt else ("1" if b.block_hash is not None else "0")
                for b in pool.blocks
            ),
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            cached_tokens_by_source=dict(kv.hits_by_source),
            prompt_tokens=self.stats.prompt_tokens,
            generation_tokens=self.stats.generation_tokens,
            steps=self.stats.steps,
            host=host,
            spec=spec,
        )

    def shutdown(self) -> None:
        """Persist the host tier to the disk tier, if any (clean shutdown); stop the other
        tensor-parallel ranks."""
        if self.host is not None:
            cached = [(h, b.block_id) for h, b in self.kv.pool.cached.items()]
            self.host.flush_to_disk(cached)
        if self.tp is not None:
            self.tp.close()

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One batch: schedule -> execute -> update -> outputs -> propose. A failure that
        belongs to one request (non-finite logits, detokenizer error) fails that request only;
        a failed forward fails the requests of that batch; the engine keeps serving. Failures
        in scheduling itself are engine bugs and propagate."""
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return []
        start = StepStart.of(scheduled, self.kv if self.proposer is not None else None)
        grammar = self.structured.step_mask(scheduled.scheduled) if self.structured else None
        ran = self.runner.execute(scheduled, grammar)
        outputs = self._update(scheduled, ran, start)
        outputs += self._outputs(ran, start)
        if self.drafter is not None:
            self._draft(scheduled, ran, start, outputs)
        return outputs

    def _update(
        self, scheduled: SchedulerOutput, ran: RunnerOutput, start: StepStart
    ) -> list[RequestOutput]:
        """The step's results enter the requests: failures end theirs (their outputs are
        returned), tokens are appended (the scheduler), grammars advance, embeddings end."""
        failed = [self._fail(request, why) for request, why in ran.failed]
        self.stats.steps += 1
        self.stats.prompt_tokens += sum(
            max(0, min(s.request.num_prompt_tokens - s.request.num_computed_tokens,
                       s.num_new_tokens))
            for s in scheduled.scheduled
        )  # fmt: skip
        self.scheduler.update(scheduled, ran.token_ids())
        if self.structured is not None:
            emitted = [(s.request, start.new_tokens(s.request)) for s, _ in ran.sampled]
            for request in self.structured.advance(emitted):
                self.scheduler.finish(request.request_id, FinishReason.STOP)
        for request, _ in ran.pooled:  # an embedding request ends with its prefill
            self.scheduler.finish(request.request_id, FinishReason.STOP)
        return failed

    def _outputs(self, ran: RunnerOutput, start: StepStart) -> list[RequestOutput]:
        for request, first, entries in ran.scored:
            self.outputs.add_prompt_logprobs(request, first, entries)
        outputs = [self.outputs.pooled_output(r, vector) for r, vector in ran.pooled]
        for s, res in ran.sampled:
            request = s.request
            tokens = start.new_tokens(request)
            self.stats.generation_tokens += len(tokens)
            try:
                outputs.append(
                    self.outputs.step_output(request, tokens, res.logprobs[: len(tokens)])
                )
            except Exception:
                log.exception("request %s: output processing failed", request.request_id)
                outputs.append(self._fail(request, "detokenization failed"))
        return outputs

    def _draft(
        self,
        scheduled: SchedulerOutput,
        ran: RunnerOutput,
        start: StepStart,
        outputs: list[RequestOutput],
    ) -> None:
        """Record how many drafts the target kept; let the draft head catch up and draft (when
        it is a source); pick each decoding request's drafts for the next step."""
        assert self.drafter is not None
        for s, res in ran.sampled:
            if s.num_spec:
                kept = len(res.token_ids) - 1
                drafts = s.request.drafts
                if self.proposer is not None and drafts is not None and drafts.source == "eagle":
                    self.proposer.stats.record(s.num_spec, kept)  # the head's own adaptive k
                    record_acceptance(s.request, s.num_spec, kept)
                self.drafter.record(s.request, s.num_spec, kept)
        if self.proposer is not None and ran.hidden is not None:
            self._propose(scheduled, ran, start, outputs)
        decoding = [s.request for s, _ in ran.sampled if not s.request.is_finished]
        self.drafter.propose(decoding)
        for request in self.scheduler.finished_this_step.values():
            self.drafter.finished(request)

    def _propose(
        self,
        scheduled: SchedulerOutput,
        ran: RunnerOutput,
        start: StepStart,
        outputs: list[RequestOutput],
    ) -> None:
        """Catch the draft's KV up over what the target kept this step; draft for next step.
        Finished requests catch up too: their cached blocks keep complete draft KV."""
        assert self.proposer is not None and ran.hidden is not None
        failed = {o.request_id for o in outputs if o.error is not None}
        sampled = {s.request.request_id for s, _ in ran.sampled}
        items, row = [], 0
        for s in scheduled.scheduled:
            r = s.request
            first = start.counts[r.request_id][0]
            kept = r.num_computed_tokens - first
            if r.request_id not in failed and kept > 0:
                # only a chunk that sampled proposes: it alone got lookahead slots
                features = ran.hidden[row : row + kept]
                items.append(CatchUp(r, first, features, r.request_id in sampled))
            row += s.num_new_tokens
        proposing = [i.request for i in items if i.propose and not i.request.is_finished]
        acceptance = sum(r.spec_acceptance for r in proposing) / max(1, len(proposing))
        k = self.proposer.choose_k(len(proposing), acceptance)
        whole_step = len(items) == len(scheduled.scheduled) and all(
            i.features.shape[0] == s.num_new_tokens for i, s in zip(items, scheduled.scheduled)
        )
        self.proposer.run(items, start.tables, k, self.runner.last_plan if whole_step else None)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish(request.request_id, FinishReason.ERROR)
        return self.outputs.final_output(request, error=message)


@dataclass(slots=True)
class StepStart:
    """Where each scheduled request stood before the step: (num_computed_tokens, num_tokens)
    by request id, and, for the proposer, the block tables (a request that finishes this step
    frees its table, but its draft KV still catches up into those blocks)."""

    counts: dict[str, tuple[int, int]]
    tables: dict[str, list[int]]

    @classmethod
    def of(cls, scheduled: SchedulerOutput, kv: KVCacheManager | None) -> StepStart:
        counts = {
            s.request.request_id: (s.request.num_computed_tokens, s.request.num_tokens)
            for s in scheduled.scheduled
        }
        tables = {rid: kv.block_ids(rid) for rid in counts} if kv is not None else {}
        return cls(counts, tables)

    def new_tokens(self, request: Request) -> list[int]:
        """The tokens the step appended to `request`."""
        return request.all_token_ids[self.counts[request.request_id][1] :]
