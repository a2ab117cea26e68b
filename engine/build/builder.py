"""Everything an engine is built from, built once from an `EngineConfig`: the model and its
draft head, the tokenizer, the KV pool's size and layout, the attention backend, the host and
disk tiers, and the objects that step (KV manager, scheduler, runner, proposer).
`EngineInfo` (engine/core/engine_info.py) is the plain, immutable summary of that build that any
thread may read."""

from __future__ import annotations

import gc
import json
import logging
import os
import traceback
from dataclasses import dataclass, replace

import torch

from engine.attention import BackendChoice, DeviceFacts, select_backend
from engine.attention.base import AttentionBackend
from engine.attention.matrix import dtype_name
from engine.config import DTYPE_NAMES, EngineConfig, parse_bytes
from engine.spec.drafting import Drafter
from engine.core.engine_info import EngineInfo
from engine.kv.disk import DiskTier
from engine.kv.host import HostTier
from engine.kv.identity import hash_root_from_seed, kv_namespace
from engine.kv.manager import KVCacheManager
from engine.weights.quantization import (
    WEIGHT_ONLY,
    quantize_model,
    quantize_weight_only,
    serve_gguf_blocks,
)
from engine.runner.model_runner import ModelRunner, allocate_kv_caches
from engine.runner.pooling import resolve_pooling
from engine.core.scheduler import Scheduler
from engine.spec.cost import MEASURED_ROWS, SpecCostModel, measured_shape
from engine.spec.cost import measure as measure_spec_cost
from engine.spec.eagle import Proposer
from engine.grammar.structured_output import StructuredOutputs
from engine.parallel.tensor_parallel import TPGroup, WorkerBuild, start_ranks
from engine.build.warmup import warm_up
from models import gguf_linear
from models.eagle.head import EagleHead, load_eagle_head
from models.eagle.shipped import shipped_head_for
from models.layers import measure_packed_rows, onednn_pack_refusal, pack_linears
from models.llama import LlamaForCausalLM
from models.loader import checkpoint_dtype, default_model_path, load_model
from models.quant import can_quantize
from models.spec import ModelSpec
from models.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("kvserve.engine")


@dataclass(slots=True)
class EngineParts:
    info: EngineInfo
    model: LlamaForCausalLM
    spec: ModelSpec
    draft: EagleHead | None
    tokenizer: Tokenizer | None
    eos_token_ids: frozenset[int]
    kv_caches: list[torch.Tensor]
    host: HostTier | None
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    proposer: Proposer | None
    drafter: Drafter | None
    structured: StructuredOutputs | None  # None without a tokenizer or xgrammar
    tp: TPGroup | None = None  # the other tensor-parallel ranks


def build_engine(config: EngineConfig) -> EngineParts:
    config.validate()
    tp = start_ranks(config)  # first, so that the other ranks load while this one does
    try:
        return _build(config, tp)
    except BaseException:
        if tp is not None:
            tp.close()
        raise


def _build(config: EngineConfig, tp: TPGroup | None) -> EngineParts:
    model_path = config.model or default_model_path()
    device = config.resolved_device()
    facts = DeviceFacts.detect(device)
    dtype, dtype_reason = config.dtype_choice(facts, checkpoint_dtype(model_path))
    log.info("dtype %s (%s)", dtype_name(dtype), dtype_reason)
    if tp is not None:
        tp.send("load", str(dtype))
    kv_dtype, kv_reason = kv_cache_dtype(config, dtype, device)
    dtype_size = torch.empty((), dtype=kv_dtype).element_size()  # KV bytes per element
    # what cannot serve here is refused before the weights load (minutes for a large model)
    if config.quantization == "int8" and (why_not := can_quantize(device)) is not None:
        raise ValueError(f"--quantization int8: {why_not}")
    if config.quantization in WEIGHT_ONLY and (device.type != "cpu" or gguf_linear.load() is None):
        raise ValueError(
            f"--quantization {config.quantization}: the block kernel is a CPU path and needs "
            "kvserve's C++ ops (a compiler); serve the float model instead"
        )
    torch.manual_seed(config.seed)
    model, spec = load_model(model_path, dtype, device, tp.shard if tp is not None else None)
    # this rank's part and geometry (under tensor parallelism, its heads and FFN columns)
    shard = tp.shard(spec) if tp is not None else None
    local = shard.spec if shard is not None else spec
    draft = _load_draft_head(config, model, dtype, device)
    packed_bytes = 0
    weights = f"{dtype_name(dtype)} (the serving dtype)"
    gguf_note, gguf_served = "", False
    if config.quantization == "auto":
        gguf_note, gguf_served = serve_gguf_blocks(model, model_path, spec, device, shard)
    if config.cpu_packed_weights:
        packed_bytes = pack_linears(model) + (pack_linears(draft) if draft is not None else 0)
        if device.type == "cpu" and (refusal := onednn_pack_refusal(dtype)) is not None:
            log.warning("no oneDNN-packed weights for %s here: %s", dtype_name(dtype), refusal)
            weights += f"; unpacked: oneDNN refuses packed {dtype_name(dtype)} here ({refusal})"
        elif device.type == "cpu" and (rows := measure_packed_rows(model)):
            log.info("linear layers: %s", rows)
            weights += f"; {rows}"
    if gguf_served:  # measured with the dense copies in place
        key = (
            model_path, os.path.getmtime(model_path), str(dtype), config.gguf_int8_activations,
            config.cpu_packed_weights, torch.get_num_threads(), config.tensor_parallel_size,
        )  # fmt: skip
        crossover = gguf_linear.measure_crossover(model, dtype, config.gguf_int8_activations, key)
        log.info("GGUF block kernel against the dense path: %s", crossover)
        gguf_note += f"; {crossover}"
    if gguf_note:
        weights = f"{gguf_note}; other weights {weights}"
    # The pool and the backend see the draft's layer as one more layer with its own KV group.
    pool_spec = local
    if draft is not None:
        draft_layer = draft.cfg.layer_spec(kv_group=len(spec.kv_groups))
        pool_spec = replace(local, layers=local.layers + (draft_layer,))
    tokenizer = _try_tokenizer(model_path)
    max_model_len = min(
        config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings
    )
    block_size = block_size_for(config, pool_spec, facts, dtype, device)
    kv_block_bytes = pool_spec.kv_bytes_per_token(dtype_size) * block_size
    # every rank holds the same blocks: the pool is sized by the rank whose blocks are largest
    sizing_bytes = max(kv_block_bytes, tp.largest_block_bytes(spec, dtype_size, block_size)
                       if tp is not None else 0)  # fmt: skip
    choice, backend, num_blocks, graphs = _choose_and_warm_up(
        config,
        model,
        pool_spec,
        facts,
        dtype,
        device,
        block_size,
        sizing_bytes,
        max_model_len,
        kv_dtype,
    )
    backend_cls = choice.backend
    kv_caches = backend.kv_caches
    if config.quantization == "int8":
        weights = quantize_model(model, backend, tokenizer, num_blocks, block_size, device)
    elif config.quantization in WEIGHT_ONLY:
        weights = quantize_weight_only(
            model,
            config.quantization,
            backend,
            tokenizer,
            num_blocks,
            block_size,
            device,
            config.cpu_packed_weights,
            config.gguf_int8_activations,
        )
    host = _host_tier(config, model_path, spec, dtype, block_size, backend_cls, kv_caches, draft,
                      sizing_bytes)  # fmt: skip
    if config.kv_hash_seed:
        hash_root = hash_root_from_seed(config.kv_hash_seed)
    else:
        hash_root = host.disk.root_seed if host is not None and host.disk is not None else None
    copier = block_prefix_copier(backend_cls, kv_caches)
    if tp is not None and host is not None:
        host.mirror = tp.send  # each rank copies its shard of the blocks rank 0 moves
    kv = KVCacheManager(
        num_blocks,
        block_size,
        config.enable_prefix_caching,
        host,
        copier if tp is None else tp.mirrored_copier(copier),
        hash_root=hash_root,
    )
    scheduler = Scheduler(
        kv,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        preempt_by_swap=config.preemption_mode == "swap" and host is not None,
        num_lookahead_tokens=config.num_speculative_tokens if draft else 0,
        short_prefill_tokens=config.short_prefill_tokens,
    )
    runner = ModelRunner(model, backend, kv, device, draft.cfg.aux_layers if draft else ())
    runner.tp = tp
    if graphs:
        runner.capture_cuda_graphs(config.max_num_seqs, max_model_len, scratch_block=num_blocks)
    proposer = None
    if draft is not None:
        proposer = Proposer(
            draft,
            backend,
            block_size,
            config.num_speculative_tokens,
            config.spec_max_verify_rows,
            device,
        )
    drafter = _drafter(config, draft)
    if drafter is not None and tokenizer is not None:
        drafter.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
    if drafter is not None and config.spec_cost_model:
        # steps of more rows than a step may verify never enter a choice of k
        rows = tuple(r for r in MEASURED_ROWS if r <= max(2, config.spec_max_verify_rows))
        key = (
            model_path, os.path.getmtime(model_path), str(dtype), str(kv_dtype),
            config.quantization, config.gguf_int8_activations, config.cpu_packed_weights,
            backend_cls.__name__, str(device), block_size, getattr(draft, "source", None),
            measured_shape(rows, draft is not None, num_blocks, block_size),
            torch.get_num_threads(), config.tensor_parallel_size,
        )  # fmt: skip
        cost = _MEASURED_COSTS.get(key)
        if cost is None:
            cost = measure_spec_cost(model, draft, backend, num_blocks, block_size, device, rows)
            _MEASURED_COSTS[key] = cost
        log.info("speculation step costs (rows: target/draft): %s", cost.table())
        drafter.cost = cost
        if proposer is not None:
            proposer.cost = cost
    kernel_table = (
        f"{choice.table}\n  dtype {dtype_name(dtype)}: {dtype_reason}\n  weights: {weights}"
        f"\n  kv cache: {kv_reason}"
    )
    if tp is not None:  # the ranks build their pools and warm up, then each step is shared
        ranks = tp.start_serving(
            WorkerBuild(backend_cls.name, block_size, num_blocks, kv_dtype,
                        host.num_blocks if host is not None else 0),
            config.tensor_parallel_timeout_s,
        )  # fmt: skip
        model.set_reduce(tp.reduce)
        tp.share_logits(model.lm_head, spec.vocab_size)
        kernel_table += "\n" + tp.plan.table(spec, dtype_size)
        kernel_table += "".join(f"\n    rank {r}: {s}" for r, s in enumerate(ranks, start=1))
    eos = spec.eos_token_ids or (
        [tokenizer.eos_token_id] if tokenizer and tokenizer.eos_token_id is not None else []
    )
    structured = _structured_outputs(tokenizer, spec.vocab_size, list(eos))
    if proposer is not None:
        proposer.structured = structured
    info = EngineInfo(
        model_path=model_path,
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        dtype=dtype_name(dtype),
        dtype_reason=dtype_reason,
        device=str(device),
        packed_weight_bytes=packed_bytes,
        num_blocks=num_blocks,
        block_size=block_size,
        kv_block_bytes=kv_block_bytes,
        prefix_caching=config.enable_prefix_caching,
        kv_bytes_per_token=spec.kv_bytes_per_token(dtype_size),
        kv_bytes_per_token_unshared=spec.kv_bytes_per_token_unshared(dtype_size),
        num_kv_groups=len(spec.kv_groups),
        draft_kv_bytes_per_token=pool_spec.kv_bytes_per_token(dtype_size)
        - spec.kv_bytes_per_token(dtype_size),
        attention_backend=backend_cls.name,
        device_label=facts.label,
        compiled_decode=getattr(backend, "decode_op", None) is not None,
        cuda_graphs=runner.graph_sizes(),
        kernel_table=kernel_table,
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        draft_layout=draft.cfg.layout if draft is not None else None,
        draft_source=draft.source if draft is not None else "",
        num_speculative_tokens=config.num_speculative_tokens if drafter is not None else 0,
        draft_sources=drafter.sources if drafter is not None else (),
        spec_max_verify_rows=config.spec_max_verify_rows,
        spec_cost=drafter.cost.table() if drafter is not None and drafter.cost else "",
        has_host_tier=host is not None,
        pooling=resolve_pooling(model_path, config.pooling),
        kv_namespace=kv_namespace(
            model_path,
            spec=repr(spec),
            dtype=str(dtype),
            quantization=config.quantization,
            block_size=block_size,
            backend=backend_cls.name,
            # a different head of the same layout only lowers acceptance (verification is
            # lossless), so the head's layout is enough here
            draft=draft.cfg.layout if draft is not None else None,
            block_layout=repr(_block_layout(backend_cls, kv_caches)),
        ),
        host_block_bytes=host.block_bytes if host is not None else 0,
        tensor_parallel_size=config.tensor_parallel_size,
    )
    return EngineParts(
        info,
        model,
        spec,
        draft,
        tokenizer,
        frozenset(eos),
        kv_caches,
        host,
        kv,
        scheduler,
        runner,
        proposer,
        drafter,
        structured,
        tp,
    )


def use_cuda_graphs(
    config: EngineConfig, device: torch.device, backend_cls: type[AttentionBackend]
) -> bool:
    """Decode steps run as CUDA graphs on CUDA, unless --enforce-eager, where the backend can
    capture them (FlashInfer; the torch and xformers paths plan data-dependent shapes), and not
    under tensor parallelism (the graphs would have to capture the ranks' all-reduces)."""
    return (
        device.type == "cuda"
        and not config.enforce_eager
        and backend_cls.supports_cuda_graphs
        and config.tensor_parallel_size == 1
    )


def kv_cache_dtype(
    config: EngineConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.dtype, str]:
    """The KV cache's dtype and why: the serving dtype, or bfloat16 under a float32 model on CPU
    (half the bytes per token: twice the tokens in the same pool and tiers; the C++ decode op
    and the torch paths read it into float32 arithmetic)."""
    requested = config.kv_cache_dtype
    if requested == "auto" or DTYPE_NAMES.get(requested) == dtype:
        return dtype, f"{dtype_name(dtype)} (the serving dtype)"
    if requested in ("fp8", "int8"):
        raise ValueError(
            f"--kv-cache-dtype {requested}: quantized KV (per-block scales) is not available "
            "yet; bfloat16 halves a float32 cache"
        )
    if requested != "bfloat16" or dtype != torch.float32:
        raise ValueError(
            f"--kv-cache-dtype {requested} under {dtype_name(dtype)} weights: a cache narrower "
            "than the model is bfloat16 under float32"
        )
    if device.type != "cpu":
        raise ValueError(
            "--kv-cache-dtype bfloat16 under float32 is a CPU path; on CUDA serve bf16"
        )
    return torch.bfloat16, "bfloat16 under float32 activations (half the bytes of float32 KV)"


def _choose_and_warm_up(
    config: EngineConfig,
    model: LlamaForCausalLM,
    pool_spec: ModelSpec,
    facts: DeviceFacts,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    kv_block_bytes: int,
    max_model_len: int,
    kv_dtype: torch.dtype,
) -> tuple[BackendChoice, AttentionBackend, int, bool]:
    """Pick the attention backend from the kernel matrix, allocate its workspace, size and
    allocate the KV pool, and warm the backend up (engine/build/warmup.py). A backend that fails its
    warm-up is passed over loudly, with the reason in the matrix's "warm-up" row, and the next
    one is tried; a forced one is a startup error, and so is a slow fallback under
    --require-fast-kernels. Returns the choice, the backend over its pool, the number of
    usable blocks and whether decode steps will be captured as CUDA graphs (those reserve one
    extra block past the pool, where padded rows write)."""
    failed: dict[str, str] = {}
    while True:
        choice = select_backend(
            pool_spec,
            facts,
            dtype,
            block_size,
            config.attention_backend,
            config.allow_slow_dtype,
            config.require_fast_kernels,
            failed,
        )
        backend_cls = choice.backend
        graphs = use_cuda_graphs(config, device, backend_cls)
        # the backend's workspace first: the pool is sized from the memory left after it
        workspace = backend_cls.allocate_workspace(device)
        num_blocks = _num_blocks(config, device, kv_block_bytes, max_model_len, block_size)
        kv_caches = allocate_kv_caches(
            backend_cls,
            pool_spec.kv_groups,
            num_blocks + int(graphs),
            block_size,
            kv_dtype,
            device,
        )
        backend = backend_cls(pool_spec, kv_caches, block_size, workspace)
        reason = _warm_up_failure(model, backend, pool_spec, num_blocks, block_size, device)
        if reason is not None:
            if config.attention_backend != "auto":
                raise ValueError(f"attention backend {backend_cls.name!r} (forced) {reason}")
            failed[backend_cls.name] = reason
            # the failed pool must be gone before the next is sized from the free memory
            del backend, kv_caches, workspace
            release_device_memory(device)
            continue
        if failed:
            log.warning(
                "attention: %s passed over after failed warm-ups; serving with %s",
                ", ".join(failed),
                backend_cls.name,
            )
        return choice, backend, num_blocks, graphs


def block_size_for(
    config: EngineConfig,
    spec: ModelSpec,
    facts: DeviceFacts,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """--block-size, else the device's default (CPU 64; CUDA 16, FlashInfer's pages), except
    that on CUDA pages of 64 are taken where only they let a fast backend serve: xformers'
    paged operator reads whole 64-token key blocks, and at 16 the torch fallback would."""
    size = config.resolved_block_size()
    if config.block_size is not None or device.type != "cuda":
        return size
    for candidate in (size, 64):
        try:
            choice = select_backend(spec, facts, dtype, candidate, config.attention_backend,
                                    config.allow_slow_dtype)  # fmt: skip
        except ValueError:
            continue  # nothing serves at this size; the real selection says why
        if choice.backend.name != "torch":
            return candidate
    return size


def _warm_up_failure(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    pool_spec: ModelSpec,
    num_blocks: int,
    block_size: int,
    device: torch.device,
) -> str | None:
    """Why the backend's warm-up failed, or None. The traceback is logged as text and not kept:
    its frames hold the backend and its KV pool, which must be freed before the next try."""
    try:
        warm_up(model, backend, pool_spec, num_blocks, block_size, device)
    except Exception as e:  # noqa: BLE001 - any failure disqualifies the backend
        reason = f"warm-up failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log.error("attention backend %s %s\n%s", backend.name, reason, traceback.format_exc())
        return reason
    return None


def release_device_memory(device: torch.device) -> None:
    """Hand freed device memory back to the driver (the caching allocator keeps it otherwise,
    and the free memory the next pool is sized from would not include it)."""
    gc.collect()  # tensors held only by reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _drafter(config: EngineConfig, head: EagleHead | None) -> Drafter | None:
    """The draft sources `speculative_method` asks for, of those this server has."""
    method, k = config.speculative_method, config.num_speculative_tokens
    if method == "off" or k <= 0:
        return None
    sources = ("grammar", "suffix", "eagle") if method == "auto" else (method,)
    sources = tuple(s for s in sources if s != "eagle" or head is not None)
    log.info("speculative decoding: drafts from %s, at most %d per request", sources, k)
    return Drafter(sources, k, config.spec_max_verify_rows)


def _load_draft_head(
    config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> EagleHead | None:
    if config.num_speculative_tokens <= 0 or config.speculative_method == "off":
        return None
    if config.speculative_method == "auto" and not config.speculative_model:
        # the shipped head keeps ~0.4 of its first drafts and its catch-up runs every step:
        # measured below 1x beside suffix drafts (bench/speculative.py), so auto takes a head
        # only when one is named
        return None
    if config.speculative_method not in ("auto", "eagle"):
        return None
    path = config.speculative_model
    if not path:
        # the model, not the flag, decides: a shipped head trained for these very weights
        path = shipped_head_for(model.embed_tokens.weight)
        if path is None:
            raise ValueError(
                "speculative_method eagle needs speculative_model (a draft head directory): "
                "no shipped head was trained for this model (its weights match none)"
            )
    head = load_eagle_head(path, model, dtype, device)
    head.source = path if config.speculative_model else f"{path} (shipped; matched by weights)"
    log.info(
        "speculative decoding: %s head from %s, k=%d",
        head.cfg.layout,
        head.source,
        config.num_speculative_tokens,
    )
    return head


# Step costs measured in this process, by what they depend on: an engine built again on the
# same weights, kernels and pool shape (tests, notebooks) reuses the measurement.
_MEASURED_COSTS: dict[tuple, SpecCostModel] = {}


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


def _num_blocks(
    config: EngineConfig,
    device: torch.device,
    block_bytes: int,
    max_model_len: int,
    block_size: int,
) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - total * (1 - config.gpu_memory_utilization)
    else:
        budget = parse_bytes(config.kv_cache_memory)
    # Never more than every sequence at full length could use.
    per_sequence = -(-max_model_len // block_size)
    blocks = min(int(budget // block_bytes), config.max_num_seqs * per_sequence)
    if device.type == "cuda" and blocks < per_sequence:
        # a pool that cannot hold one full-length sequence is a server that cannot hold a
        # conversation: refuse with the numbers instead of serving from a block or two
        raise ValueError(
            f"the KV pool would hold {max(blocks, 0) * block_size} tokens, less than one "
            f"{max_model_len}-token sequence: {free / 2**30:.2f} of {total / 2**30:.2f} GiB are "
            f"free at --gpu-memory-utilization {config.gpu_memory_utilization}; lower "
            "--max-model-len, raise the utilization, or free the GPU"
        )
    return max(1, blocks)


def _host_tier(
    config: EngineConfig,
    model_path: str,
    spec: ModelSpec,
    dtype: torch.dtype,
    block_size: int,
    backend_cls: type[AttentionBackend],
    kv_caches: list[torch.Tensor],
    draft: EagleHead | None,
    sizing_bytes: int,
) -> HostTier | None:
    host_bytes = parse_bytes(config.host_bytes)
    if host_bytes <= 0 or not config.enable_prefix_caching:
        return None
    disk = None
    if config.disk_path:
        layout = _block_layout(backend_cls, kv_caches)
        fingerprint = json.dumps(
            {
                "model": os.path.abspath(model_path),
                "spec": repr(spec),
                "dtype": str(dtype),
                "block_size": block_size,
                "backend": backend_cls.name,
                "draft": os.path.abspath(config.speculative_model or "-") if draft else None,
                "layout": repr(layout),
                # hashes chain from the disk tier's root seed, so a warm restart reuses it
            },
            sort_keys=True,
        )
        disk = DiskTier(config.disk_path, fingerprint, layout, parse_bytes(config.disk_bytes))
    # as many slots on every tensor-parallel rank, sized by the largest rank's blocks
    return HostTier(kv_caches, backend_cls.block_dim, host_bytes, disk, host_bytes // sizing_bytes)


def _block_layout(
    backend_cls: type[AttentionBackend], kv_caches: list[torch.Tensor]
) -> list[tuple[torch.Size, torch.dtype]]:
    """One block's shape and dtype in each KV group (the pool's size left out)."""
    bd = backend_cls.block_dim
    return [(c.shape[:bd] + c.shape[bd + 1 :], c.dtype) for c in kv_caches]


def block_prefix_copier(backend_cls: type[AttentionBackend], kv_caches: list[torch.Tensor]):
    """copy(src, dst, n): the first n slots of block src into block dst, in every KV group
    (token-granular prefix reuse of a partially matching cached block)."""
    bd, sd = backend_cls.block_dim, backend_cls.slot_dim - 1

    def copy(src: int, dst: int, num_tokens: int) -> None:
        for cache in kv_caches:
            cache.select(bd, dst).narrow(sd, 0, num_tokens).copy_(
                cache.select(bd, src).narrow(sd, 0, num_tokens)
            )

    return copy
