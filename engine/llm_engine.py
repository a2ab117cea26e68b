"""The synchronous engine: adds, aborts and steps requests. One step is
schedule -> execute -> sample -> update -> output -> propose. Building lives in
`engine/builder.py`, text and stop strings in `engine/output_processor.py`. Single-threaded by
design; `AsyncEngine` drives it from its own thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.builder import build_engine
from engine.config import EngineConfig
from engine.engine_info import EngineInfo
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.pooling import normalize
from engine.request import FinishReason, Request
from engine.sampler import SamplerOutput, sample
from engine.sampling_params import ParamError, SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.snapshot import EngineSnapshot, take_snapshot
from engine.spec_decode import CatchUp, record_acceptance, verify

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
        self.runner, self.proposer = parts.runner, parts.proposer
        self.structured = parts.structured
        self.outputs = OutputProcessor(parts.tokenizer, parts.scheduler)
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
        return take_snapshot(self)

    def shutdown(self) -> None:
        """Persist the host tier to the disk tier, if any (clean shutdown)."""
        if self.host is not None:
            cached = [(h, b.block_id) for h, b in self.kv.pool.cached.items()]
            self.host.flush_to_disk(cached)

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One batch. A failure that belongs to one request (non-finite logits, detokenizer
        error) fails that request only; a failed forward fails the requests of that batch; the
        engine keeps serving. Failures in scheduling itself are engine bugs and propagate."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        try:
            logits, hidden = self.runner.execute(out)
        except Exception:
            log.exception(
                "forward pass failed; failing the %d requests of this batch", len(out.scheduled)
            )
            return [self._fail(s.request, "the forward pass failed") for s in out.scheduled]
        outputs: list[RequestOutput] = []
        pooled = self._pool(hidden, out.scheduled, outputs)
        try:
            results = self._sample(logits, out.scheduled, outputs)
        except Exception:  # a sampling bug must not kill the engine thread: isolate it
            log.exception("sampling failed; sampling the batch's requests one by one")
            results = self._sample_isolated(logits, out.scheduled, outputs)
        self.stats.steps += 1
        self.stats.prompt_tokens += sum(
            max(
                0,
                min(s.request.num_prompt_tokens - s.request.num_computed_tokens, s.num_new_tokens),
            )
            for s in out.scheduled
        )
        before = {
            s.request.request_id: (s.request.num_computed_tokens, s.request.num_tokens)
            for s in out.scheduled
        }
        tables = {rid: self.kv.block_ids(rid) for rid in before} if self.proposer else {}
        self.scheduler.update(out, {s.request.request_id: r.token_ids for s, r in results})
        self._advance_grammars(results, before)
        for request, embedding in pooled:  # an embedding request ends with its prefill
            self.scheduler.finish(request.request_id, FinishReason.STOP)
            outputs.append(self.outputs.pooled_output(request, embedding))
        for item, res in results:
            request = item.request
            tokens = request.all_token_ids[before[request.request_id][1] :]
            self.stats.generation_tokens += len(tokens)
            try:
                output = self.outputs.step_output(request, tokens, res.logprobs[: len(tokens)])
                if output.finished and request.sampling_params.export_kv:
                    # its blocks were freed this step but stay cached: nothing evicts them
                    # before the next allocation
                    output.kv_blocks = self.kv.export_prompt(request)
                outputs.append(output)
            except Exception:
                log.exception("request %s: output processing failed", request.request_id)
                outputs.append(self._fail(request, "detokenization failed"))
        if self.proposer is not None:
            failed = {o.request_id for o in outputs if o.error is not None}
            sampled = {s.request.request_id for s, _ in results}
            self._propose(out, hidden, before, tables, failed, sampled)
        return outputs

    def _pool(
        self,
        hidden: torch.Tensor,
        scheduled: list[ScheduledRequest],
        outputs: list[RequestOutput],
    ) -> list[tuple[Request, torch.Tensor]]:
        """Embedding requests (engine/pooling.py): mean pooling adds this chunk's hidden rows to
        the request's running sum; a chunk that ends the prefill yields the pooled, normalised
        vector (float32, on the CPU). A non-finite vector fails its request alone."""
        width = self.model.spec.hidden_size  # the final-normed hidden state (not EAGLE-3's aux)
        ends: list[tuple[Request, torch.Tensor]] = []
        row = 0
        for s in scheduled:
            r, n = s.request, s.num_new_tokens
            mode = r.sampling_params.pooling
            if mode == "mean":
                chunk = hidden[row : row + n, :width].float().sum(dim=0)
                r.pooled_sum = chunk if r.pooled_sum is None else r.pooled_sum + chunk
                if s.pools:
                    ends.append((r, r.pooled_sum / r.num_prompt_tokens))
            elif mode == "last" and s.pools:
                ends.append((r, hidden[row + n - 1, :width]))
            row += n
        if not ends:
            return []
        vectors = normalize(torch.stack([v for _, v in ends])).cpu()
        finite = vectors.isfinite().all(dim=-1).tolist()
        pooled = []
        for (r, _), vector, ok in zip(ends, vectors, finite):
            r.pooled_sum = None
            if ok:
                pooled.append((r, vector))
            else:
                log.error("request %s: non-finite hidden state; failing it", r.request_id)
                outputs.append(self._fail(r, "the model produced a NaN/inf hidden state"))
        return pooled

    def _sample(
        self,
        logits: torch.Tensor,
        scheduled: list[ScheduledRequest],
        outputs: list[RequestOutput],
    ) -> list[tuple[ScheduledRequest, SamplerOutput]]:
        """Sample plain rows, verify drafted ones; requests with non-finite logits fail alone
        (their failure outputs go to `outputs`)."""
        sampling = [s for s in scheduled if s.samples]
        spans, row = [], 0
        for s in sampling:
            spans.append((row, row + 1 + s.num_spec))
            row += 1 + s.num_spec
        # a row's sum is NaN/+inf iff the row holds a NaN/+inf (logits are far below float32's
        # overflow): one pass over [rows, vocab] instead of isfinite's four. -inf is a masked
        # token (a grammar's, when a failed batch is sampled again row by row), not a fault.
        sums = logits.sum(dim=-1) if sampling else logits.new_empty(0)
        finite = (~(sums.isnan() | sums.isposinf())).tolist()
        plain, drafted = [], []
        for s, (a, b) in zip(sampling, spans):
            if not all(finite[a:b]):
                log.error("request %s: non-finite logits; failing it", s.request.request_id)
                outputs.append(self._fail(s.request, "the model produced NaN/inf logits"))
            elif s.num_spec:
                drafted.append((s, a, b))
            else:
                plain.append((s, a))
        constrained = [(s, a) for s, a in plain if s.request.matcher is not None] + [
            (s, a) for s, a, _ in drafted if s.request.matcher is not None
        ]
        if constrained:  # in place (rows of this step's own tensor, made row-contiguous)
            logits = logits.contiguous()
            self._mask_grammar_rows(logits, constrained)
        results: list[tuple[ScheduledRequest, SamplerOutput]] = []
        if plain:
            picked, plain_logits = [a for _, a in plain], logits
            if picked != list(range(logits.shape[0])):  # all rows in order: no gather, no upload
                rows = torch.tensor(picked, device=logits.device)
                plain_logits = logits.index_select(0, rows)
            res = sample(plain_logits, [s.request for s, _ in plain])
            results.extend(
                (s, SamplerOutput([t], [lp]))
                for (s, _), t, lp in zip(plain, res.token_ids, res.logprobs)
            )
        if drafted:
            rows = torch.cat([torch.arange(a, b) for _, a, b in drafted]).to(logits.device)
            verified = verify(logits.index_select(0, rows), [s.request for s, _, _ in drafted])
            assert self.proposer is not None
            for (s, _, _), res in zip(drafted, verified):
                self.proposer.stats.record(s.num_spec, len(res.token_ids) - 1)
                record_acceptance(s.request, s.num_spec, len(res.token_ids) - 1)
                results.append((s, res))
        return results

    def _mask_grammar_rows(
        self, logits: torch.Tensor, items: list[tuple[ScheduledRequest, int]]
    ) -> None:
        """Constrained rows of `logits` keep only what their grammar allows. items: (scheduled
        request, its first row). A drafted request's row j is masked at the state after its
        drafts d_1..d_j (a draft the grammar refuses ends its rows: the verifier rejects it)."""
        assert self.structured is not None
        rows, matchers = [], []
        drafted: list[tuple[ScheduledRequest, int]] = []
        for s, row in items:
            if s.num_spec:
                drafted.append((s, row))
            else:
                rows.append(row)
                matchers.append(s.request.matcher)
        self.structured.mask_logits(logits, rows, matchers)
        for s, row in drafted:
            m = s.request.matcher
            accepted = 0
            self.structured.mask_logits(logits, [row], [m])
            for j, token in enumerate(s.request.spec_token_ids):
                if m.is_terminated() or not m.accept_token(token):
                    break
                accepted += 1
                if not m.is_terminated():  # past the grammar's end: the verifier stops there
                    self.structured.mask_logits(logits, [row + j + 1], [m])
            if accepted:
                m.rollback(accepted)

    def _advance_grammars(
        self,
        results: list[tuple[ScheduledRequest, SamplerOutput]],
        before: dict[str, tuple[int, int]],
    ) -> None:
        """Each constrained request's grammar takes the tokens it emitted this step; a grammar
        that has reached its end ends the request (even under ignore_eos)."""
        for s, _ in results:
            r = s.request
            if r.matcher is None:
                continue
            for token in r.all_token_ids[before[r.request_id][1] :]:
                if r.matcher.is_terminated():
                    break
                if not r.matcher.accept_token(token):
                    log.error("request %s: grammar refused sampled token %d", r.request_id, token)
                    break
            if r.matcher.is_terminated() and not r.is_finished:
                self.scheduler.finish(r.request_id, FinishReason.STOP)

    def _sample_isolated(
        self,
        logits: torch.Tensor,
        scheduled: list[ScheduledRequest],
        outputs: list[RequestOutput],
    ) -> list[tuple[ScheduledRequest, SamplerOutput]]:
        """`_sample` per request, after the batched call raised: a request whose sampling
        raises again fails alone; the others keep their tokens."""
        results: list[tuple[ScheduledRequest, SamplerOutput]] = []
        row = 0
        for s in scheduled:
            if not s.samples:
                continue
            n = 1 + s.num_spec
            if s.request.is_finished:  # failed in the batched call already (non-finite logits)
                row += n
                continue
            try:
                results.extend(self._sample(logits[row : row + n], [s], outputs))
            except Exception:
                log.exception("request %s: sampling failed; failing it", s.request.request_id)
                outputs.append(self._fail(s.request, "sampling failed"))
            row += n
        return results

    def _propose(
        self,
        out: SchedulerOutput,
        hidden: torch.Tensor,
        before: dict[str, tuple[int, int]],
        tables: dict[str, list[int]],
        failed: set[str],
        sampled: set[str],
    ) -> None:
        """Catch the draft's KV up over what the target kept this step; draft for next step.
        Finished requests catch up too: their cached blocks keep complete draft KV."""
        assert self.proposer is not None
        items, row = [], 0
        for s in out.scheduled:
            r = s.request
            start = before[r.request_id][0]
            kept = r.num_computed_tokens - start
            if r.request_id not in failed and kept > 0:
                # only a chunk that sampled proposes: it alone got lookahead slots
                items.append(CatchUp(r, start, hidden[row : row + kept], r.request_id in sampled))
            row += s.num_new_tokens
        proposing = [i.request for i in items if i.propose and not i.request.is_finished]
        acceptance = sum(r.spec_acceptance for r in proposing) / max(1, len(proposing))
        k = self.proposer.choose_k(len(proposing), acceptance)
        whole_step = len(items) == len(out.scheduled) and all(
            i.features.shape[0] == s.num_new_tokens for i, s in zip(items, out.scheduled)
        )
        self.proposer.run(items, tables, k, self.runner.last_plan if whole_step else None)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish(request.request_id, FinishReason.ERROR)
        return self.outputs.final_output(request, error=message)
