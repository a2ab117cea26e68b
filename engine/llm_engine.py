"""The synchronous engine: owns the model, the KV cache, the scheduler and the per-request
detokenizers. `step()` runs one batch and returns the per-request deltas. Single-threaded by
design; `AsyncEngine` drives it from its own thread."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from engine.attention import DeviceFacts, select_backend
from engine.config import EngineConfig, parse_bytes
from engine.detokenizer import IncrementalDetokenizer
from engine.disk_tier import DiskTier
from engine.host_tier import HostTier
from engine.kv_cache_manager import KVCacheManager
from engine.model_runner import ModelRunner, allocate_kv_caches
from engine.outputs import RequestOutput
from engine.request import FinishReason, Request
from engine.sampler import SamplerOutput, TokenLogprobs, sample
from engine.sampling_params import ParamError, SamplingParams
from engine.scheduler import ScheduledRequest, Scheduler
from engine.spec_decode import CatchUp, Proposer, record_acceptance, verify
from models.eagle.head import EagleHead, load_eagle_head
from models.layers import pack_linears
from models.loader import default_model_path, load_model
from models.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("kvserve.engine")

# The self-distilled EAGLE-1 head shipped for the default model (models/eagle/train.py).
DEFAULT_DRAFT_HEAD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "models",
    "eagle",
    "heads",
    "smollm2-135m-instruct",
)


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    finished: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_path = config.model or default_model_path()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self.dtype_size = torch.empty((), dtype=self.dtype).element_size()
        torch.manual_seed(config.seed)
        self.model, self.spec = load_model(self.model_path, self.dtype, self.device)
        self.draft = self._load_draft_head()
        self.packed_weight_bytes = 0
        if config.cpu_packed_weights:
            self.packed_weight_bytes = pack_linears(self.model) + (
                pack_linears(self.draft) if self.draft is not None else 0
            )
        # The pool and the backend see the draft's layer as one more layer with its own KV group.
        self.pool_spec = self.spec
        if self.draft is not None:
            draft_layer = self.draft.cfg.layer_spec(kv_group=len(self.spec.kv_groups))
            self.pool_spec = replace(self.spec, layers=self.spec.layers + (draft_layer,))
        self.tokenizer: Tokenizer | None = self._try_tokenizer()
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings,
            self.spec.max_position_embeddings,
        )
        self.block_size = config.resolved_block_size()
        self.num_blocks = self._num_blocks()
        self.device_facts = DeviceFacts.detect(self.device)
        self.backend_choice = select_backend(
            self.pool_spec,
            self.device_facts,
            self.dtype,
            self.block_size,
            config.attention_backend,
            config.allow_slow_dtype,
            config.require_fast_kernels,
        )
        self.backend_cls = self.backend_choice.backend
        self.kv_caches = allocate_kv_caches(
            self.backend_cls,
            self.pool_spec.kv_groups,
            self.num_blocks,
            self.block_size,
            self.dtype,
            self.device,
        )
        self.host = self._host_tier()
        self.kv = KVCacheManager(
            self.num_blocks,
            self.block_size,
            config.enable_prefix_caching,
            self.host,
            self._copy_block_prefix,
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            preempt_by_swap=config.preemption_mode == "swap" and self.host is not None,
            num_lookahead_tokens=config.num_speculative_tokens if self.draft else 0,
        )
        if self.host is not None and self.host.disk is not None:
            self.kv.pool.root_hash = self.host.disk.root_seed
        backend = self.backend_cls(self.pool_spec, self.kv_caches, self.block_size)
        aux = self.draft.cfg.aux_layers if self.draft else ()
        self.runner = ModelRunner(self.model, backend, self.kv, self.device, aux)
        self.proposer = (
            Proposer(
                self.draft,
                backend,
                self.block_size,
                config.num_speculative_tokens,
                config.spec_max_verify_rows,
                self.device,
            )
            if self.draft is not None
            else None
        )
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.eos_token_ids = frozenset(
            self.spec.eos_token_ids
            or (
                [self.tokenizer.eos_token_id]
                if self.tokenizer and self.tokenizer.eos_token_id is not None
                else []
            )
        )
        self.stats = EngineStats()

    def _load_draft_head(self) -> EagleHead | None:
        if self.config.num_speculative_tokens <= 0:
            return None
        path = self.config.speculative_model
        if not path:
            if self.config.model:
                raise ValueError(
                    "num_speculative_tokens > 0 needs speculative_model (a draft head directory) "
                    "for a model other than the default"
                )
            path = DEFAULT_DRAFT_HEAD
        head = load_eagle_head(path, self.model, self.dtype, self.device)
        log.info(
            "speculative decoding: %s head from %s, k=%d",
            head.cfg.layout,
            path,
            self.config.num_speculative_tokens,
        )
        return head

    def _host_tier(self) -> HostTier | None:
        host_bytes = parse_bytes(self.config.host_bytes)
        if host_bytes <= 0 or not self.config.enable_prefix_caching:
            return None
        disk = None
        if self.config.disk_path:
            layout = [
                (
                    c.shape[: self.backend_cls.block_dim]
                    + c.shape[self.backend_cls.block_dim + 1 :],
                    c.dtype,
                )
                for c in self.kv_caches
            ]
            fingerprint = json.dumps(
                {
                    "model": os.path.abspath(self.model_path),
                    "spec": repr(self.spec),
                    "dtype": str(self.dtype),
                    "block_size": self.block_size,
                    "backend": self.backend_cls.name,
                    "draft": os.path.abspath(self.config.speculative_model or "-")
                    if self.draft
                    else None,
                    "layout": repr(layout),
                    # hashes chain from the pool's root seed, so a warm restart must reuse it
                },
                sort_keys=True,
            )
            disk = DiskTier(
                self.config.disk_path, fingerprint, layout, parse_bytes(self.config.disk_bytes)
            )
        return HostTier(self.kv_caches, self.backend_cls.block_dim, host_bytes, disk)

    def _copy_block_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first num_tokens slots of block src into block dst, in every KV group."""
        bd, sd = self.backend_cls.block_dim, self.backend_cls.slot_dim - 1
        for cache in self.kv_caches:
            cache.select(bd, dst).narrow(sd, 0, num_tokens).copy_(
                cache.select(bd, src).narrow(sd, 0, num_tokens)
            )

    def offload_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Move an idle session's cached blocks to the host tier; returns blocks moved."""
        return self.kv.offload_prefix(token_ids, cache_salt)

    def shutdown(self) -> None:
        """Persist the host tier to the disk tier, if any (clean shutdown)."""
        if self.host is not None:
            cached = [(h, b.block_id) for h, b in self.kv.pool.cached.items()]
            self.host.flush_to_disk(cached)

    def _try_tokenizer(self) -> Tokenizer | None:
        try:
            return load_tokenizer(self.model_path)
        except FileNotFoundError:
            log.warning("no tokenizer found at %s: token-id prompts only", self.model_path)
            return None

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        block_bytes = self.kv_block_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.config.gpu_memory_utilization)
        else:
            budget = parse_bytes(self.config.kv_cache_memory)
        # Never more than every sequence at full length could use.
        ceiling = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(int(budget // block_bytes), ceiling))

    @property
    def kv_block_bytes(self) -> int:
        return self.pool_spec.kv_bytes_per_token(self.dtype_size) * self.block_size

    # ---- requests ----------------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ParamError("prompt", "prompt must contain at least one token")
        vocab = self.spec.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ParamError("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt_token_ids)} in the messages, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
            )
        if -(-total // self.block_size) > self.num_blocks:
            raise ParamError(
                "max_tokens",
                f"{total} tokens need more than the {self.num_blocks * self.block_size} tokens of "
                "KV cache this server has",
            )
        for token_id in params.logit_bias:
            if not 0 <= token_id < vocab:
                raise ParamError("logit_bias", f"token id {token_id} is outside the vocabulary")

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Request:
        self.validate_prompt(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id}")
        request = Request(
            request_id, list(prompt_token_ids), params, self.eos_token_ids, self.max_model_len
        )
        self.scheduler.add(request)
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.stop,
                params.skip_special_tokens,
                params.include_stop_str_in_output,
            )
        return request

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        request = self.scheduler.finish(request_id, reason)
        detok = self.detokenizers.pop(request_id, None)
        if request is None:
            return None
        return RequestOutput(
            request_id,
            [],
            detok.flush(True) if detok else "",
            True,
            reason.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

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
        sampling = [s for s in out.scheduled if s.samples]
        results, failed = self._sample(logits, sampling, outputs)
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
        sampled = {s.request.request_id: res.token_ids for s, res in results}
        self.scheduler.update(out, sampled)
        if self.proposer is not None:
            self._propose(out.scheduled, hidden, before, tables, failed, set(sampled))
        now = time.monotonic()
        for item, res in results:
            request = item.request
            tokens = request.all_token_ids[before[request.request_id][1] :]
            self.stats.generation_tokens += len(tokens)
            if request.first_token_time is None:
                request.first_token_time = now
            try:
                outputs.append(self._output(request, tokens, res.logprobs[: len(tokens)]))
            except Exception:
                log.exception("request %s: output processing failed", request.request_id)
                outputs.append(self._fail(request, "detokenization failed"))
        return outputs

    def _sample(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest], outputs: list[RequestOutput]
    ) -> tuple[list[tuple[ScheduledRequest, SamplerOutput]], set[str]]:
        """Sample plain rows, verify drafted ones; requests with non-finite logits fail alone."""
        spans, row = [], 0
        for s in sampling:
            spans.append((row, row + 1 + s.num_spec))
            row += 1 + s.num_spec
        # a row's sum is NaN/inf iff the row holds a NaN/inf (logits are far below float32's
        # overflow): one pass over [rows, vocab] instead of isfinite's four
        finite = torch.isfinite(logits.sum(dim=-1)).tolist() if sampling else []
        failed: set[str] = set()
        plain, drafted = [], []
        for s, (a, b) in zip(sampling, spans):
            if not all(finite[a:b]):
                log.error("request %s: non-finite logits; failing it", s.request.request_id)
                outputs.append(self._fail(s.request, "the model produced NaN/inf logits"))
                failed.add(s.request.request_id)
            elif s.num_spec:
                drafted.append((s, a, b))
            else:
                plain.append((s, a))
        results: list[tuple[ScheduledRequest, SamplerOutput]] = []
        if plain:
            rows = torch.tensor([a for _, a in plain], device=logits.device)
            res = sample(logits.index_select(0, rows), [s.request for s, _ in plain])
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
        return results, failed

    def _propose(
        self,
        scheduled: list[ScheduledRequest],
        hidden: torch.Tensor,
        before: dict[str, tuple[int, int]],
        tables: dict[str, list[int]],
        failed: set[str],
        sampled: set[str],
    ) -> None:
        """Catch the draft's KV up over what the target kept this step; draft for next step."""
        assert self.proposer is not None
        items, row = [], 0
        for s in scheduled:
            r = s.request
            start = before[r.request_id][0]
            kept = r.num_computed_tokens - start
            if r.request_id not in failed and kept > 0:
                # only a chunk that sampled proposes: it alone got lookahead slots
                items.append(CatchUp(r, start, hidden[row : row + kept], r.request_id in sampled))
            row += s.num_new_tokens
        k = self.proposer.choose_k(sum(1 for i in items if i.propose and not i.request.is_finished))
        whole_step = len(items) == len(scheduled) and all(
            i.features.shape[0] == s.num_new_tokens for i, s in zip(items, scheduled)
        )
        self.proposer.run(items, tables, k, self.runner.last_plan if whole_step else None)

    def _fail(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish(request.request_id, FinishReason.ERROR)
        self.detokenizers.pop(request.request_id, None)
        return RequestOutput(
            request.request_id,
            [],
            "",
            True,
            FinishReason.ERROR.value,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            error=message,
        )

    def _output(
        self, request: Request, tokens: list[int], lps: list[TokenLogprobs | None]
    ) -> RequestOutput:
        """The step's delta for a request. Under speculation several tokens arrive at once; a
        stop string matched inside them drops the tokens after it, as if never generated."""
        detok = self.detokenizers.get(request.request_id)
        if detok is not None:
            for j, token in enumerate(tokens):
                matched = detok.add([token])
                if matched is None:
                    continue
                if not request.is_finished:
                    self.scheduler.finish(request.request_id, FinishReason.STOP)
                request.finish_reason, request.stop_reason = FinishReason.STOP, matched
                dropped = len(tokens) - j - 1
                if dropped:
                    del request.all_token_ids[-dropped:]
                    tokens, lps = tokens[: j + 1], lps[: j + 1]
                break
        finished = request.is_finished
        text = detok.flush(finished) if detok else ""
        if finished:
            self.detokenizers.pop(request.request_id, None)
            self.stats.finished += 1
        return RequestOutput(
            request.request_id,
            tokens,
            text,
            finished,
            request.finish_reason.value if finished and request.finish_reason else None,
            request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_output_tokens=request.num_output_tokens,
            logprobs=[lp for lp in lps if lp is not None],
        )
