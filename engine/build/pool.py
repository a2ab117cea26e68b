"""The KV phase of a build: the cache's dtype, the block size, how many blocks the pool
holds, the attention backend chosen from the kernel matrix and warmed up over its pool (the next
one tried when a warm-up fails), and the host and disk tiers below the pool. A tensor-parallel
worker allocates and warms its shard's pool with the same `pool_for`."""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import traceback
from collections.abc import Callable

import torch

from engine.attention import BackendChoice, DeviceFacts, kv_quant, select_backend
from engine.attention.base import AttentionBackend
from engine.attention.matrix import dtype_name
from engine.build import window as window_phase
from engine.build.warmup import warm_up
from engine.config import DEFAULT_HOST_BYTES, DTYPE_NAMES, EngineConfig, parse_bytes
from engine.kv.disk import DiskTier
from engine.kv.host import HostTier
from engine.runner.model_runner import allocate_kv_caches
from models.eagle.head import EagleHead
from models.llama import LlamaForCausalLM
from models.spec import ModelSpec

log = logging.getLogger("kvserve.engine")


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
    config: EngineConfig, dtype: torch.dtype, device: torch.device, spec: ModelSpec
) -> tuple[torch.dtype, str]:
    """The KV cache's dtype and why: the serving dtype; bfloat16 under a float32 model on CPU
    (half the bytes per token: twice the tokens in the same pool and tiers; the C++ decode op
    and the torch paths read it into float32 arithmetic); or int8 rows with a float32 scale per
    32 values (engine/attention/kv_quant.py: 0.56x a bf16 cache's bytes), read by the C++ ops
    and the torch backend's PyTorch paths. The int8 cache's accuracy is measured once the pool
    is warm (engine/build/kv_judge.py)."""
    requested = config.kv_cache_dtype
    if requested == "auto" or DTYPE_NAMES.get(requested) == dtype:
        return dtype, f"{dtype_name(dtype)} (the serving dtype)"
    if requested == "fp8":
        raise ValueError(
            "--kv-cache-dtype fp8: no kernel here reads fp8 pages (the CPU has no fp8 "
            "arithmetic, and the CUDA backends are not built for them); --kv-cache-dtype int8 "
            "stores 1.125 bytes a value"
        )
    if requested == "int8":
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"--kv-cache-dtype int8 under {dtype_name(dtype)}: the attention "
                "ops take float32 or bfloat16 queries"
            )
        if why := kv_quant.refusal(tuple(lay.head_dim for lay in spec.layers)):
            raise ValueError(f"--kv-cache-dtype int8: {why}")
        return torch.int8, (
            f"int8 rows, a float32 scale per {kv_quant.GROUP} values "
            f"({kv_quant.bytes_per_value(torch.int8)} bytes a value)"
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


def choose_and_warm_up(
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
    reclaim_refusal: Callable[[type[AttentionBackend]], str | None] = lambda cls: "",
) -> tuple[BackendChoice, AttentionBackend, int, bool, int, str | None]:
    """Pick the attention backend from the kernel matrix, allocate its workspace, size and
    allocate the KV pool, and warm the backend up (engine/build/warmup.py). A backend that fails
    its warm-up is passed over loudly, with the reason in the matrix's "warm-up" row, and the next
    one is tried; a forced one is a startup error, and so is a slow fallback under
    --require-fast-kernels. Returns the choice, the backend over its pool, the number of
    usable blocks and whether decode steps will be captured as CUDA graphs (those reserve one
    extra block past the pool, where padded rows write); then the sliding-window layers' own
    pool's blocks (0: none; `reclaim_refusal` of the backend says why, engine/build/window.py)
    and the refusal."""
    failed: dict[str, str] = {}
    while True:
        choice = configured_backend(config, pool_spec, facts, dtype, block_size, kv_dtype, failed)
        backend_cls = choice.backend
        graphs = use_cuda_graphs(config, device, backend_cls)
        # the backend's workspace first: the pool is sized from the memory left after it
        workspace = backend_cls.allocate_workspace(device)
        refusal = reclaim_refusal(backend_cls)
        window_blocks, windowed, reserved, block_bytes = 0, set(), 0, kv_block_bytes
        if refusal is None:
            size = kv_quant.bytes_per_value(kv_dtype)
            block_bytes, window_bytes = window_phase.block_bytes(pool_spec, size, block_size)
            # never more than the full pool: a request's window table is no longer than its full one
            cap = config.num_kv_blocks or config.max_num_seqs * -(-max_model_len // block_size)
            window_blocks = window_phase.window_blocks_for(config, pool_spec, block_size, cap)
            windowed = window_phase.windowed_groups(pool_spec) or set()
            if config.num_kv_blocks is None:
                # a request's window table is never longer than its full one: past the full
                # pool's size, window blocks could only starve the full-context groups (every
                # sequence's window at a small budget left them a block or two)
                balanced = int(kv_budget(config, device) // (window_bytes + block_bytes))
                least = window_phase.window_blocks_for(config, pool_spec, block_size, cap, 1)
                window_blocks = min(window_blocks, max(balanced, least))
            reserved = window_blocks * window_bytes
        num_blocks = num_blocks_for(
            config, device, block_bytes, max_model_len, block_size, reserved
        )
        counts = [
            window_blocks if g in windowed else num_blocks + int(graphs)
            for g in range(len(pool_spec.kv_groups))
        ]
        caches = allocate_kv_caches(
            backend_cls,
            pool_spec.group_specs or pool_spec.kv_groups,
            counts,
            block_size,
            kv_dtype,
            device,
        )
        backend = backend_cls(pool_spec, caches, block_size, workspace)
        del caches  # the backend holds the pool: a failed warm-up's frees with it
        warm = functools.partial(warm_up, model, backend, pool_spec, num_blocks, block_size, device)
        reason = _warm_up_failure(backend.name, warm)
        del warm  # (it holds the backend too)
        if reason is not None:
            if config.attention_backend != "auto":
                raise ValueError(f"attention backend {backend_cls.name!r} (forced) {reason}")
            failed[backend_cls.name] = reason
            # the failed pool must be gone before the next is sized from the free memory
            del backend, workspace
            release_device_memory(device)
            continue
        if failed:
            log.warning(
                "attention: %s passed over after failed warm-ups; serving with %s",
                ", ".join(failed),
                backend_cls.name,
            )
        return choice, backend, num_blocks, graphs, window_blocks, refusal


def pool_for(
    model: LlamaForCausalLM,
    backend_cls: type[AttentionBackend],
    spec: ModelSpec,
    num_blocks: int,
    block_size: int,
    kv_dtype: torch.dtype,
    device: torch.device,
) -> AttentionBackend:
    """A backend rank 0 chose, over a pool of the blocks rank 0 sized, warmed up: a
    tensor-parallel worker's KV phase (its shard's geometry, rank 0's decisions)."""
    workspace = backend_cls.allocate_workspace(device)
    caches = allocate_kv_caches(
        backend_cls, spec.group_specs or spec.kv_groups, num_blocks, block_size, kv_dtype, device
    )
    backend = backend_cls(spec, caches, block_size, workspace)
    warm_up(model, backend, spec, num_blocks, block_size, device)
    return backend


def configured_backend(
    config: EngineConfig,
    spec: ModelSpec,
    facts: DeviceFacts,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype,
    failed: dict[str, str] | None = None,
) -> BackendChoice:
    """`select_backend` as the config asks: --attention-backend, --allow-slow-dtype and
    --require-fast-kernels (`failed`: the backends whose warm-up failed, with the reason)."""
    return select_backend(
        spec,
        facts,
        dtype,
        block_size,
        config.attention_backend,
        config.allow_slow_dtype,
        config.require_fast_kernels,
        failed,
        kv_dtype,
    )


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
            choice = select_backend(
                spec, facts, dtype, candidate, config.attention_backend, config.allow_slow_dtype
            )
        except ValueError:
            continue  # nothing serves at this size; the real selection says why
        if choice.backend.name != "torch":
            return candidate
    return size


def _warm_up_failure(name: str, warm: Callable[[], None]) -> str | None:
    """Why the warm-up `warm` of backend `name` failed, or None. The traceback is logged as text
    and not kept: its frames hold the backend and its KV pool, which must be freed before the
    next try."""
    try:
        warm()
    except Exception as e:  # noqa: BLE001 - any failure disqualifies the backend
        reason = f"warm-up failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log.error("attention backend %s %s\n%s", name, reason, traceback.format_exc())
        return reason
    return None


def release_device_memory(device: torch.device) -> None:
    """Hand freed device memory back to the driver (the caching allocator keeps it otherwise,
    and the free memory the next pool is sized from would not include it)."""
    gc.collect()  # tensors held only by reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kv_budget(config: EngineConfig, device: torch.device) -> float:
    """The bytes the KV pools may take: on CUDA what --gpu-memory-utilization leaves free, on
    CPU --kv-cache-memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - total * (1 - config.gpu_memory_utilization)
    return parse_bytes(config.kv_cache_memory)


def num_blocks_for(
    config: EngineConfig,
    device: torch.device,
    block_bytes: int,
    max_model_len: int,
    block_size: int,
    reserved: int = 0,
) -> int:
    """The pool's blocks of `block_bytes`: --num-kv-blocks, else what the memory budget holds
    after `reserved` bytes (the window pool's)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = kv_budget(config, device) - reserved
    # Never more than every sequence at full length could use.
    per_sequence = -(-max_model_len // block_size)
    blocks = min(int(budget // block_bytes), config.max_num_seqs * per_sequence)
    if device.type == "cuda" and blocks < per_sequence:
        # a pool that cannot hold one full-length sequence is a server that cannot hold a
        # conversation: refuse with the numbers instead of serving from a block or two
        free, total = torch.cuda.mem_get_info(device)
        raise ValueError(
            f"the KV pool would hold {max(blocks, 0) * block_size} tokens, less than one "
            f"{max_model_len}-token sequence: {free / 2**30:.2f} of {total / 2**30:.2f} GiB are "
            f"free at --gpu-memory-utilization {config.gpu_memory_utilization}; lower "
            "--max-model-len, raise the utilization, or free the GPU"
        )
    return max(1, blocks)


def host_tier(
    config: EngineConfig,
    model_path: str,
    spec: ModelSpec,
    dtype: torch.dtype,
    block_size: int,
    backend_cls: type[AttentionBackend],
    kv_caches: list[torch.Tensor],
    draft: EagleHead | None,
    sizing_bytes: int,
    mirror: Callable[[str, list[int], list[int]], None] | None = None,
) -> HostTier | None:
    """The host tier (and the disk tier under it) the config asks for; `mirror`: tells the
    other tensor-parallel ranks each copy between device and storage."""
    host_bytes = config.host_tier_bytes()  # a disk path alone brings a host tier
    if host_bytes <= 0 or not config.enable_prefix_caching:
        return None
    disk = None
    if config.disk_path:
        layout = block_layout(backend_cls, kv_caches)
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
    return HostTier(
        kv_caches, backend_cls.block_dim, host_bytes, disk, host_bytes // sizing_bytes, mirror
    )


def host_tier_lines(config: EngineConfig, host: HostTier) -> str:
    """The banner's lines for the host tier and the disk tier under it: a size the operator
    did not give is named as the default it is."""
    text = f"\n  host tier: {host.describe()}"
    if parse_bytes(config.host_bytes) <= 0 and config.disk_path:
        text += f" (--disk-path without --host-bytes: {DEFAULT_HOST_BYTES} by default)"
    if host.disk is not None:
        text += f"\n  disk tier: {host.disk.describe()}"
    return text


def block_layout(
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
            # a compressed group's block holds fewer entries than tokens (DeepSeek V4): all of
            # them move; those of windows past `num_tokens` are rewritten before they are read
            n = min(num_tokens, cache.shape[sd + 1])
            cache.select(bd, dst).narrow(sd, 0, n).copy_(cache.select(bd, src).narrow(sd, 0, n))

    return copy
