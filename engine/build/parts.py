"""What the build phases decide and hand on (engine/build/builder.py runs them): the KV phase's
decisions and what it built (`Pool`), every object an engine is made of (`EngineParts`), and the
plain, immutable summary any thread may read (`engine_info`: engine/core/engine_info.py's
`EngineInfo`, with the banner's figures)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import BackendChoice, DeviceFacts, cpu_prefill, kv_quant
from engine.attention.base import AttentionBackend
from engine.attention.matrix import dtype_name
from engine.build import pool as kv_phase
from engine.build import window as window_phase
from engine.build.weights import LoadedWeights
from engine.config import EngineConfig
from engine.core.engine_info import EngineInfo
from engine.core.output_processor import OutputProcessor
from engine.core.scheduler import Scheduler
from engine.grammar.structured_output import StructuredOutputs
from engine.kv.host import HostTier
from engine.kv.identity import kv_namespace
from engine.kv.manager import KVCacheManager
from engine.lora.registry import LoRARegistry
from engine.parallel.tensor_parallel import TPGroup
from engine.runner.model_runner import ModelRunner
from engine.runner.pooling import resolve_pooling
from engine.spec.drafting import Drafter
from models.eagle.head import EagleHead
from models.llama import LlamaForCausalLM
from models.spec import ModelSpec
from models.tokenizer import Tokenizer
from models.vision import AnyImageProcessor


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
    outputs: OutputProcessor
    drafter: Drafter | None
    structured: StructuredOutputs | None  # None without a tokenizer or xgrammar
    loras: LoRARegistry
    tp: TPGroup | None = None  # the other tensor-parallel ranks
    image_processor: AnyImageProcessor | None = None  # a vision model's (models/vision.py)


@dataclass(frozen=True, slots=True)
class Pool:
    """The KV phase's decisions and what it built."""

    spec: ModelSpec  # the pool's layers: this rank's, plus the draft head's layer
    kv_dtype: torch.dtype
    kv_reason: str
    block_size: int
    kv_block_bytes: int
    sizing_bytes: int  # the largest rank's block: every rank holds the same blocks
    max_model_len: int
    choice: BackendChoice
    backend: AttentionBackend
    num_blocks: int
    graphs: bool
    window_blocks: int  # the sliding-window layers' own pool (0: they share the pool above)
    window_refusal: str | None  # why they keep every block, where they do (None: reclaimed)
    prefill_attention: str  # which CPU prefill attention serves, as measured ("": no choice)

    @property
    def scratch_blocks(self) -> int:
        """Blocks a startup forward may use (ids below this exist in every KV group)."""
        return window_phase.scratch_blocks(self.num_blocks, self.window_blocks)


def window_kv(pool: Pool) -> str:
    """The banner's words for the sliding-window layers' KV."""
    if pool.window_blocks:
        return (
            f"windowed layers: a pool of their own, {pool.window_blocks} blocks, holding "
            "each request's window (blocks behind it go back as it advances)"
        )
    if pool.window_refusal and pool.window_refusal != "no sliding-window layers":
        return f"windowed layers keep KV for every token: {pool.window_refusal}"
    return ""


def engine_info(
    config: EngineConfig,
    model_path: str,
    weights: LoadedWeights,
    pool: Pool,
    draft: EagleHead | None,
    drafter: Drafter | None,
    host: HostTier | None,
    dtype: torch.dtype,
    dtype_reason: str,
    facts: DeviceFacts,
    packed_bytes: int,
    kernel_table: str,
    runner: ModelRunner,
) -> EngineInfo:
    spec, pool_spec, backend = weights.spec, pool.spec, pool.backend
    backend_cls, kv_caches, device = type(backend), backend.kv_caches, runner.device
    num_blocks, block_size, max_model_len = pool.num_blocks, pool.block_size, pool.max_model_len
    kv_block_bytes = pool.kv_block_bytes
    dtype_size = kv_quant.bytes_per_value(pool.kv_dtype)
    return EngineInfo(
        model_path=model_path,
        architecture=spec.architecture,
        architecture_traits=spec.traits(),
        window_kv=window_kv(pool),
        kv_cache_bytes=sum(c.numel() * c.element_size() for c in kv_caches),
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
        kv_bytes_per_token_full_context=(
            spec.kv_bytes_per_token_at(max_model_len, dtype_size)
            if pool.window_blocks
            else spec.kv_bytes_per_token(dtype_size)
        ),
        num_kv_groups=len(spec.kv_groups),
        draft_kv_bytes_per_token=pool_spec.kv_bytes_per_token(dtype_size)
        - spec.kv_bytes_per_token(dtype_size),
        attention_backend=backend_cls.name,
        device_label=facts.label,
        compiled_decode=getattr(backend, "decode_op", None) is not None,
        compiled_prefill=(  # queries in the serving dtype: bf16 operands only on a bf16 cache
            cpu_prefill.arithmetic(
                dtype if pool.kv_dtype == dtype else torch.float32, backend.prefill_op
            )
            if getattr(backend, "prefill_op", None) is not None
            else None
        ),
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
        draft_corpus=drafter.corpus.describe() if drafter and drafter.corpus is not None else "",
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
            block_layout=repr(kv_phase.block_layout(backend_cls, kv_caches)),
        ),
        host_block_bytes=host.block_bytes if host is not None else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        image_token_id=spec.vision.image_token_id if runner.images is not None else None,
        tokens_per_image=spec.vision.tokens_per_image if runner.images is not None else 0,
        encoder_cache_bytes=runner.images.cache.capacity_bytes if runner.images else 0,
        vision=spec.vision if runner.images is not None else None,
    )
