"""`--quantization int8` at startup: smooth the float model on calibration text (SmoothQuant,
so per-tensor activation quantization keeps its accuracy), then give its linear layers int8
weights (models/quant.py). Runs after the attention backend's warm-up, through the same plan +
forward, writing KV only into blocks no request owns yet."""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.attention.matrix import dtype_name
from engine.model_runner import step_metadata
from models.llama import LlamaForCausalLM
from models.quant import CALIBRATION, input_ranges, needs_reduce_range, quantize_linears, smooth
from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.int8")


@torch.inference_mode()
def quantize_model(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    tokenizer: Tokenizer | None,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    alpha: float = 0.8,  # SmolLM2, alpha 0.5 / 0.65 / 0.8 / 0.9: top-1 0.88 / 0.86 / 0.93 / 0.88
) -> str:
    """Smooth, quantize, and describe the result for the kernel matrix."""
    limit = min(256, num_blocks * block_size)
    if tokenizer is not None:
        prompts = [tokenizer.encode(t, add_special_tokens=False)[:limit] for t in CALIBRATION]
    else:  # token ids only: a spread of ids stands in for text
        g = torch.Generator().manual_seed(0)
        vocab = model.spec.vocab_size
        prompts = [torch.randint(0, vocab, (min(64, limit),), generator=g).tolist()] * 4

    def run(ids: list[int]) -> None:
        table = list(range(-(-len(ids) // block_size)))
        positions, meta = step_metadata([(table, 0, len(ids))], block_size, device)
        model(torch.tensor(ids, device=device), positions, backend.plan(meta))

    smooth(model, input_ranges(model, run, prompts), alpha)
    int8_bytes = quantize_linears(model)
    bits = 7 if needs_reduce_range() else 8
    dtype = dtype_name(model.lm_head.weight.dtype)
    described = (
        f"int8 W8A8 dynamic (fbgemm, per-channel weights, SmoothQuant alpha {alpha} on "
        f"{sum(map(len, prompts))} calibration tokens; {int8_bytes / 2**20:.0f} MiB; {bits}-bit "
        f"activations by probe; lm_head {dtype})"
    )
    log.info("weights: %s", described)
    return described
