"""The synchronous engine: adds, aborts and steps requests. One step is schedule -> run
(forward, pool, sample: engine/runner/model_runner.py) -> update (the scheduler's one exit) ->
emit (engine/core/output_processor.py) -> draft (engine/spec/). Building lives in
`engine/build/`. Single-threaded by design; `AsyncEngine` drives it from its own thread."""

from __future__ import annotations

import time
from dataclasses import astuple, dataclass

from engine.build.builder import build_engine
from engine.config import EngineConfig
from engine.core.batch import GrammarMask, ScheduledRequest, StepUpdate
from engine.core.engine_info import EngineInfo
from engine.core.images import PromptImage
from engine.core.outputs import RequestOutput
from engine.core.positions import RopePositions
from engine.core.request import FinishReason, Request
from engine.core.sampling_params import LoRARef, ParamError, SamplingParams
from engine.core.snapshot import EncoderSnapshot, EngineSnapshot, HostTierSnapshot, SpecSnapshot
from engine.core.step_guard import run_step
from engine.kv.host import SWAP_IN_BUCKETS
from engine.lora.registry import LoRAAdapter
from models.mrope import mrope_positions


@dataclass(slots=True)
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    # wall time inside `step`, all steps and decode-only ones (no prompt token scheduled): what
    # a served token is compared with (bench/served_step.py)
    step_seconds: float = 0.0
    decode_steps: int = 0
    decode_step_seconds: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine(config)
        self.config = config
        self.info: EngineInfo = parts.info
        self.model, self.spec, self.draft = parts.model, parts.spec, parts.draft
        self.tokenizer = parts.tokenizer
        self.eos_token_ids = parts.eos_token_ids
        self.host, self.kv, self.scheduler = parts.host, parts.kv, parts.scheduler
        self.runner, self.drafter = parts.runner, parts.drafter
        self.structured = parts.structured
        self.loras = parts.loras
        self.tp = parts.tp
        # a vision model's images: the processor's settings and where their tokens go
        self.image_processor = parts.image_processor
        self.vision = parts.spec.vision if parts.image_processor is not None else None
        self.outputs = parts.outputs
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

    def validate_prompt(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: tuple[PromptImage, ...] = (),
    ) -> None:
        self.info.validate(prompt_token_ids, params, images)

    def rope_positions(
        self, prompt_len: int, images: tuple[PromptImage, ...]
    ) -> RopePositions | None:
        """A prompt's own rotary positions: M-RoPE's, where the model has it and the prompt
        has images (without images every axis is the token index: None)."""
        if not images or not self.spec.mrope_section or self.spec.vision is None:
            return None
        positions, delta = mrope_positions(
            prompt_len,
            [(i.offset, i.num_tokens, i.grid) for i in images],
            self.spec.vision.spatial_merge,
        )
        return RopePositions(positions, delta)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> Request:
        """Admit a request the caller's door has validated (`info.validate`: the offline `LLM`
        and `AsyncEngine.submit` each do, once, where they can answer the caller), as vLLM's
        engine core leaves validation to its input processor. `arrival_time` (time.monotonic's
        clock; now by default) is when it reached the server: its queue time and its place in
        the prefill order count from it."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id}")
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            self.eos_token_ids,
            self.max_model_len,
            device=self.runner.device,  # seeded generators draw on the engine's device
            images=tuple(images),
        )
        request.rope_positions = self.rope_positions(len(prompt_token_ids), images)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        if params.lora is not None:
            request.lora = self.loras.weights(params.lora)
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

    def add_lora(self, name: str, adapter: LoRAAdapter) -> LoRARef:
        """Serve an adapter read by `LoRARegistry.read` under `name`."""
        return self.loras.add(name, adapter)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter `name`; LoRAInUse while requests are served with it."""
        in_use = sum(
            1
            for r in self.scheduler.requests.values()
            if r.sampling_params.lora and r.sampling_params.lora.name == name
        )
        self.loras.remove(name, in_use)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def offload_prefix(
        self,
        token_ids: list[int],
        cache_salt: str | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> int:
        """Move an idle session's cached blocks to the host tier (`images`: its prompt's, whose
        content hashes key the blocks holding them); returns blocks moved."""
        return self.kv.offload_prefix(token_ids, cache_salt, images)

    def import_blocks(self, blocks: list[tuple[bytes, bytes]]) -> int:
        """Blocks fetched from the remote store into the host tier; returns how many."""
        return self.kv.import_blocks(blocks)

    def snapshot(self) -> EngineSnapshot:
        """Plain data for stats, metrics and the page (engine/core/snapshot.py); a pure read."""
        kv, sched, pool = self.kv, self.scheduler, self.kv.pool
        host = None
        if self.host is not None:
            h = self.host
            h.settle_latencies()  # swap-ins whose copies completed since (only counts them)
            disk = h.disk
            host = HostTierSnapshot(
                h.used_bytes,
                h.capacity_bytes,
                h.block_bytes,
                h.saved_blocks,
                h.loaded_blocks,
                h.evicted_blocks,
                SWAP_IN_BUCKETS,
                tuple(h.load_latency_counts),
                h.load_seconds,
                disk.integrity_failures if disk else 0,
                disk.save_failures if disk else 0,
            )
        spec = None
        if self.drafter is not None:
            s = self.drafter.total_stats()
            by_source = {
                name: (st.num_draft_tokens, st.num_accepted_tokens)
                for name, st in self.drafter.stats.items()
            }
            spec = SpecSnapshot(
                s.num_drafts,
                s.num_draft_tokens,
                s.num_accepted_tokens,
                s.mean_acceptance_length,
                self.drafter.current_k,
                list(s.accepted_per_position),
                by_source,
                tuple(self.drafter.recent_picks),
            )
        return EngineSnapshot(
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_preemptions=sched.num_preemptions,
            num_pinned_blocks=pool.num_pinned,
            pins_broken=pool.pins_broken,
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
            step_seconds=self.stats.step_seconds,
            decode_steps=self.stats.decode_steps,
            decode_step_seconds=self.stats.decode_step_seconds,
            host=host,
            spec=spec,
            encoder=(
                EncoderSnapshot(*astuple(self.runner.images.cache.stats()))
                if self.runner.images is not None
                else None
            ),
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
        """One batch: schedule -> run -> update -> emit -> draft. A failure that belongs to one
        request (a token outside the vocabulary, nothing its constraints allow, non-finite
        logits, detokenizer error) fails that request only, and a failed forward is retried
        without the request that made it fail (engine/core/step_guard.py); the engine keeps
        serving. Failures in scheduling itself are engine bugs and propagate."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.scheduled:
            return []
        ran = run_step(self.runner, self._grammar, scheduled, self.info.vocab_size)
        update = self.scheduler.update_from_output(scheduled, ran)
        self._count(update)
        outputs = self.outputs.emit(update)
        if self.drafter is not None:
            self.drafter.step(update, ran.hidden, ran.plan)
        self._time(update, time.perf_counter() - start)
        return outputs

    def _grammar(self, scheduled: list[ScheduledRequest]) -> GrammarMask | None:
        return self.structured.step_mask(scheduled) if self.structured is not None else None

    def _count(self, update: StepUpdate) -> None:
        self.stats.steps += 1
        self.stats.prompt_tokens += sum(
            max(
                0,
                min(
                    s.request.num_prompt_tokens - update.first[s.request.request_id],
                    s.num_new_tokens,
                ),
            )
            for s in update.scheduled.scheduled
        )
        self.stats.generation_tokens += sum(len(e.token_ids) for e in update.emitted)

    def _time(self, update: StepUpdate, seconds: float) -> None:
        self.scheduler.observe_step(update.scheduled, seconds)
        self.stats.step_seconds += seconds
        prompt = (
            update.first[s.request.request_id] < s.request.num_prompt_tokens
            for s in update.scheduled.scheduled
        )
        if not any(prompt):
            self.stats.decode_steps += 1
            self.stats.decode_step_seconds += seconds
            if self.drafter is not None:
                self.drafter.observe_step(update.scheduled.num_tokens, seconds)
