"""Building an engine from an `EngineConfig`, once, in phases that each take what the earlier
ones made: weights (engine/build/weights.py, the same on every tensor-parallel rank) -> the KV
pool, its backend and tiers (engine/build/pool.py) -> grammar -> the step's objects (output
processor, scheduler, runner) -> speculation (engine/build/speculation.py). Every object is
built whole, with its collaborators in its constructor. What the phases hand on, and the
`EngineInfo` summary any thread may read, are in engine/build/parts.py."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from engine.attention import DeviceFacts, kv_quant
from engine.attention.base import AttentionBackend
from engine.attention.matrix import dtype_name
from engine.attention.torch_backend import TorchBackend
from engine.build import pool as kv_phase
from engine.build import window as window_phase
from engine.build.deepseek_v4_choice import choose_v4_kernels
from engine.build.kv_judge import judge_int8_kv
from engine.build.lora import build_loras
from engine.build.parts import EngineParts, Pool, engine_info
from engine.build.prefill_choice import choose_prefill_attention
from engine.build.speculation import build_drafter, load_draft_head
from engine.build.step_costs import step_budget
from engine.build.vision import build_image_encoder, encoder_cost
from engine.build.weights import (
    LoadedWeights,
    int8_activations,
    int8_prefill,
    load_weights,
    refuse_before_loading,
    weights_key,
)
from engine.config import EngineConfig
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.grammar.structured_output import StructuredOutputs
from engine.kv.host import HostTier
from engine.kv.identity import hash_root_from_seed
from engine.kv.manager import KVCacheManager
from engine.kv.window import WindowTables
from engine.parallel.messages import Load, WorkerBuild
from engine.parallel.tensor_parallel import TPGroup, start_ranks
from engine.runner.model_runner import ModelRunner
from engine.runner.pool_memory import keep_freed_memory
from engine.weights.int8_dense import int8_dense_path
from engine.weights.quantization import (
    WEIGHT_ONLY,
    HeldOut,
    judge_int8_activations,
    quantize_model,
    quantize_weight_only,
)
from models.eagle.head import EagleHead
from models.linear.layer import pack_linears
from models.loader import checkpoint_dtype, default_model_path
from models.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("kvserve.engine")


def build_engine(config: EngineConfig) -> EngineParts:
    config.validate()
    tp = start_ranks(config)  # first, so that the other ranks load while this one does
    try:
        return _build(config, tp)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device. Kernels that launch on the current
    device (xformers' Triton kernels, a stream asked for without a device) would otherwise run
    on cuda:0 under --device cuda:N; the engine builds and steps on this one thread."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def _build(config: EngineConfig, tp: TPGroup | None) -> EngineParts:
    model_path = config.model or default_model_path()
    device = config.resolved_device()
    use_device(device)
    if device.type == "cpu":
        keep_freed_memory()  # a step's freed buffers stay mapped for the next
    facts = DeviceFacts.detect(device)
    dtype, dtype_reason = config.dtype_choice(facts, checkpoint_dtype(model_path))
    log.info("dtype %s (%s)", dtype_name(dtype), dtype_reason)
    if tp is not None:
        tp.send(Load(str(dtype)))
    refuse_before_loading(config, device)
    weights = load_weights(config, model_path, dtype, device, tp.shard if tp else None)
    draft = load_draft_head(config, weights.model, dtype, device)
    packed = weights.packed_bytes
    if draft is not None and config.cpu_packed_weights:
        packed += pack_linears(draft)
    tokenizer = _try_tokenizer(model_path)
    pool = _pool(config, weights, draft, facts, dtype, device, tp)
    key = weights_key(config, model_path, dtype)
    notes = _quantize(config, weights, pool, tokenizer, device, key)
    kv_line = pool.kv_reason
    if pool.kv_dtype == torch.int8 and isinstance(pool.backend, TorchBackend):
        kv_line += "; " + (  # rank 0 alone would measure a shard's logits
            "accuracy not measured under tensor parallelism"
            if tp is not None
            else judge_int8_kv(
                weights.model,
                pool.backend,
                pool.spec,
                tokenizer,
                dtype,
                pool.scratch_blocks,
                pool.block_size,
                device,
            )
        )
    host = kv_phase.host_tier(
        config,
        model_path,
        weights.spec,
        dtype,
        pool.block_size,
        type(pool.backend),
        pool.backend.kv_caches,
        draft,
        pool.sizing_bytes,
        tp.mirror_kv if tp else None,
    )
    kv = _kv_manager(config, pool, host, tp)
    kernel_table = (
        f"{pool.choice.table}\n  dtype {dtype_name(dtype)}: {dtype_reason}\n  weights: {notes}"
        f"\n  kv cache: {kv_line}"
    )
    if pool.prefill_attention:
        kernel_table += f"\n  prefill attention: {pool.prefill_attention}"
    if weights.spec.group_specs:  # DeepSeek V4: its decode-step kernels, measured
        v4 = choose_v4_kernels(
            weights.model, dtype, device, config.max_num_seqs, pool.block_size, pool.max_model_len
        )
        kernel_table += f"\n  decode step: {v4}" if v4 else ""
    if host is not None:
        kernel_table += kv_phase.host_tier_lines(config, host)
    spec = weights.spec
    eos = spec.eos_token_ids or (
        [tokenizer.eos_token_id] if tokenizer and tokenizer.eos_token_id is not None else []
    )
    grammars = _structured_outputs(tokenizer, spec.vocab_size, list(eos))
    outputs = OutputProcessor(tokenizer, kv.export_prompt)
    budget = step_budget(config, key, weights.model, pool.backend, pool.scratch_blocks, device)
    loras = build_loras(config, spec, dtype)
    if loras.limits.max_loras:  # the weights' methods are final (measured and judged above)
        weights.model.enable_lora()
    kernel_table += f"\n  step budget: {budget.describe()}\n  lora: {loras.describe()}"
    vision = build_image_encoder(
        config, model_path, spec, dtype, device, draft is not None, tokenizer
    )
    image_cost = encoder_cost(*vision, budget) if vision else 0.0
    if vision:
        kernel_table += f"\n  images: {image_cost:.2f} prefill tokens of a step a soft token"
    scheduler = Scheduler(
        kv,
        config.max_num_seqs,
        budget,
        preempt_by_swap=config.preemption_mode == "swap" and host is not None,
        num_lookahead_tokens=config.num_speculative_tokens if draft else 0,
        by_deadline=config.scheduling == "deadline",
        max_loras=loras.limits.max_loras,
        stop_strings=outputs.match_stop,
        grammars=grammars,
        image_cost=image_cost,
    )
    aux = draft.cfg.aux_layers if draft else ()
    runner = ModelRunner(
        weights.model, pool.backend, kv, device, aux, tp, vision[0] if vision else None
    )
    if pool.graphs:
        runner.capture_cuda_graphs(config.max_num_seqs, pool.max_model_len, pool.num_blocks)
    drafter = build_drafter(
        config, key, weights.model, draft, pool.backend, kv, grammars, tokenizer, device
    )
    # the ranks build their pools and warm up; from then on each forward is shared (the step
    # costs above are measured before: rank 0 alone, the others not yet listening)
    if tp is not None:
        kernel_table += _start_serving(config, tp, weights, pool, host)
    info = engine_info(
        config,
        model_path,
        weights,
        pool,
        draft,
        drafter,
        host,
        dtype,
        dtype_reason,
        facts,
        packed,
        kernel_table,
        runner,
    )
    return EngineParts(
        info,
        weights.model,
        spec,
        draft,
        tokenizer,
        frozenset(eos),
        pool.backend.kv_caches,
        host,
        kv,
        scheduler,
        runner,
        outputs,
        drafter,
        grammars,
        loras,
        tp,
        vision[1] if vision else None,
    )


def _pool(
    config: EngineConfig,
    weights: LoadedWeights,
    draft: EagleHead | None,
    facts: DeviceFacts,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None,
) -> Pool:
    """The pool and the backend see the draft's layer as one more layer with its own KV group."""
    spec, pool_spec = weights.spec, weights.local
    if draft is not None:
        draft_layer = draft.cfg.layer_spec(kv_group=len(spec.kv_groups))
        pool_spec = replace(pool_spec, layers=pool_spec.layers + (draft_layer,))
    kv_dtype, kv_reason = kv_phase.kv_cache_dtype(config, dtype, device, spec)
    dtype_size = kv_quant.bytes_per_value(kv_dtype)  # KV bytes a value
    max_model_len = min(
        config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings
    )
    block_size = kv_phase.block_size_for(config, pool_spec, facts, dtype, device)
    kv_block_bytes = pool_spec.kv_block_bytes(block_size, dtype_size)
    sizing_bytes = max(
        kv_block_bytes,
        tp.largest_block_bytes(spec, dtype_size, block_size) if tp is not None else 0,
    )

    def reclaim_refusal(backend_cls: type[AttentionBackend]) -> str | None:
        return window_phase.reclaim_refusal(
            config, pool_spec, backend_cls, max_model_len, tp is not None, draft is not None
        )

    choice, backend, num_blocks, graphs, window_blocks, refusal = kv_phase.choose_and_warm_up(
        config,
        weights.model,
        pool_spec,
        facts,
        dtype,
        device,
        block_size,
        sizing_bytes,
        max_model_len,
        kv_dtype,
        reclaim_refusal,
    )
    prefill = ""
    if isinstance(backend, TorchBackend) and device.type == "cpu":
        scratch = window_phase.scratch_blocks(num_blocks, window_blocks)
        prefill = choose_prefill_attention(backend, pool_spec, dtype, scratch)
    return Pool(
        pool_spec,
        kv_dtype,
        kv_reason,
        block_size,
        kv_block_bytes,
        sizing_bytes,
        max_model_len,
        choice,
        backend,
        num_blocks,
        graphs,
        window_blocks,
        refusal,
        prefill,
    )


def _quantize(
    config: EngineConfig,
    weights: LoadedWeights,
    pool: Pool,
    tokenizer: Tokenizer | None,
    device: torch.device,
    key: tuple,
) -> str:
    """Weights quantized at load, measured through the warmed-up backend before they serve
    (engine/weights/); returns the banner's weights line."""
    model = weights.model
    if config.quantization not in ("auto", "none") and weights.spec.group_specs:
        raise ValueError(
            f"--quantization {config.quantization} with {weights.spec.architecture}: "
            "its layers keep their weights in the serving dtype"
        )
    held = HeldOut(model, pool.backend, tokenizer, pool.scratch_blocks, pool.block_size, device)
    if config.quantization == "int8":
        return quantize_model(held)
    notes = weights.notes
    if config.quantization in WEIGHT_ONLY:
        notes = quantize_weight_only(
            held,
            config.quantization,
            config.cpu_packed_weights,
            int8_activations(config),
            config.spec_max_verify_rows,
            key,
        )
    judged = judge_int8_activations(held, config.gguf_int8_activations == "auto", key)
    prefill = (
        int8_dense_path(held, config.gguf_int8_prefill == "auto", key)
        if int8_prefill(config)
        else ""
    )
    return "; ".join(part for part in (notes, judged, prefill) if part)


def _kv_manager(
    config: EngineConfig, pool: Pool, host: HostTier | None, tp: TPGroup | None
) -> KVCacheManager:
    if config.kv_hash_seed:
        hash_root = hash_root_from_seed(config.kv_hash_seed)
    else:
        hash_root = host.disk.root_seed if host is not None and host.disk is not None else None
    copier = kv_phase.block_prefix_copier(type(pool.backend), pool.backend.kv_caches)
    window = None
    if pool.window_blocks:
        assert pool.spec.sliding_window is not None and host is None
        window = WindowTables(
            pool.window_blocks,
            pool.block_size,
            pool.spec.sliding_window,
            config.enable_prefix_caching,
        )
        copier = None  # a partial block's copy moves one block id across every group
    return KVCacheManager(
        pool.num_blocks,
        pool.block_size,
        config.enable_prefix_caching,
        host,
        copier if tp is None or copier is None else tp.mirrored_copier(copier),
        hash_root=hash_root,
        pin_share=config.kv_pin_share,
        window=window,
    )


def _start_serving(
    config: EngineConfig, tp: TPGroup, weights: LoadedWeights, pool: Pool, host: HostTier | None
) -> str:
    """Hand the workers rank 0's pool decisions; once each has built and warmed its shard, the
    model reduces across ranks. Returns the banner's tensor-parallel lines."""
    ranks = tp.start_serving(
        WorkerBuild(
            type(pool.backend).name,
            pool.block_size,
            pool.num_blocks,
            pool.kv_dtype,
            host.num_blocks if host is not None else 0,
        ),
        config.tensor_parallel_timeout_s,
    )
    weights.model.set_reduce(tp.reduce)
    tp.share_logits(weights.model.lm_head, weights.spec.vocab_size)
    dtype_size = kv_quant.bytes_per_value(pool.kv_dtype)
    table = "\n" + tp.plan.table(weights.spec, dtype_size)
    return table + "".join(f"\n    rank {r}: {s}" for r, s in enumerate(ranks, start=1))


def _structured_outputs(
    tokenizer: Tokenizer | None, vocab_size: int, stop_ids: list[int]
) -> StructuredOutputs | None:
    if tokenizer is None:
        return None
    try:
        return StructuredOutputs(tokenizer, vocab_size, stop_ids)
    except ImportError as e:
        log.warning("structured outputs off: %s (pip install --no-deps xgrammar)", e)
        return None


def _try_tokenizer(model_path: str) -> Tokenizer | None:
    try:
        return load_tokenizer(model_path)
    except FileNotFoundError:
        log.warning("no tokenizer found at %s: token-id prompts only", model_path)
        return None
