"""The int8 KV cache's accuracy, measured once the pool is warm: the served model's logits over
held-out text (engine/weights/quantization.HELD_OUT) attending through the int8 pool, against
the same model attending through a small pool of the serving dtype. The figure goes on the
banner's KV line; below the int8 judges' bar (the same 0.95 top-1 / 0.99 cosine as int8
activations) it also warns. The user asked for int8 by name, so it serves either way."""

from __future__ import annotations

import logging

import torch

from engine.attention.matrix import dtype_name
from engine.attention.torch_backend import TorchBackend
from engine.runner.model_runner import allocate_kv_caches
from engine.weights.quantization import (
    INT8_ACTIVATION_COSINE,
    INT8_ACTIVATION_TOP1,
    agreement,
    forward_fn,
    held_out_logits,
)
from models.llama import LlamaForCausalLM
from models.spec import ModelSpec
from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")

HELD_OUT_TOKENS = 256  # per held-out text, at most


@torch.inference_mode()
def judge_int8_kv(
    model: LlamaForCausalLM,
    backend: TorchBackend,
    spec: ModelSpec,
    tokenizer: Tokenizer | None,
    dtype: torch.dtype,
    scratch_blocks: int,
    block_size: int,
    device: torch.device,
) -> str:
    """The banner's words for the int8 cache's measured agreement with a `dtype` cache."""
    limit = min(HELD_OUT_TOKENS, scratch_blocks * block_size)
    blocks = -(-limit // block_size)
    reference = TorchBackend(
        spec,
        allocate_kv_caches(TorchBackend, spec.kv_groups, blocks, block_size, dtype, device),
        block_size,
    )
    ref, got = (
        held_out_logits(model, forward_fn(model, b, block_size, device), tokenizer, limit)()
        for b in (reference, backend)
    )
    top1, cosine = agreement(ref, got)
    measured = (
        f"vs a {dtype_name(dtype)} cache on {len(ref)} held-out positions: top-1 agreement "
        f"{top1:.2f}, logit cosine {cosine:.4f}"
    )
    if top1 < INT8_ACTIVATION_TOP1 or cosine < INT8_ACTIVATION_COSINE:
        log.warning("the int8 KV cache moves this model's logits: %s", measured)
        bar = f"{INT8_ACTIVATION_TOP1} / {INT8_ACTIVATION_COSINE}"
        return f"{measured} -- WARNING: below {bar}, answers will differ visibly"
    return measured
