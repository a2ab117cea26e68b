"""The GGUF dense path on int8 W8A8 copies (`--gguf-int8-prefill`): the steps of many rows
(prefill chunks, wide decode batches) through `torch._int_mm` instead of the bf16 GEMM, where
it is faster and the model on it still answers as on the float GEMM.

Three stages, run once at startup on the warmed model (models/linear/int8_prefill.py holds the
copies and their kernels):
1. calibrate: max |x| per input channel of every decoder weight over CALIBRATION text, so each
   copy is smoothed (SmoothQuant: per-row activation rounding otherwise takes its step from a
   few outlier channels; SmolLM2's Q4_1 agreed at top-1 0.85 unsmoothed, 0.93 smoothed);
2. time the copies against the float GEMM by rows (models/linear/measure.measure_int8_dense);
3. judge by projection: HELD_OUT's logits with the copies on, against the float GEMM, at the
   int8-activation bar. Where every projection together misses it, the projections whose inputs
   keep outliers after smoothing leave first (`LEAVE_FIRST`: the down projection's input is
   act(gate) * up, a product of two ranges; the attention output's is a mix of value rows), and
   the judge measures again, until what is left passes or nothing is.
"""

from __future__ import annotations

import logging

import torch

from engine.weights.quantization import (
    CALIBRATION,
    INT8_ACTIVATION_COSINE,
    INT8_ACTIVATION_TOP1,
    HeldOut,
    agreement,
)
from models.linear import gguf_linear, measure
from models.linear.gguf_linear import GGUFWeight

log = logging.getLogger("kvserve.int8")

# Projection names (a weight's last module name) in the order their copies leave when the judge
# refuses the set: names not listed leave before these.
LEAVE_FIRST = ("down_proj", "o_proj", "gate_up_proj", "qkv_proj")
_JUDGED: dict[tuple, tuple[tuple[str, ...], str]] = {}


@torch.inference_mode()
def calibrate(held: HeldOut) -> dict[str, torch.Tensor]:
    """max |x| per input channel (float32) of every decoder GGUF weight by module name, over
    CALIBRATION (random ids where the model has no tokenizer)."""
    served = {name for name, _ in gguf_linear.served_weights(held.model)}
    ranges: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in held.model.named_modules():
        if name not in served or name.endswith("lm_head"):
            continue

        def record(_module: torch.nn.Module, args: tuple, name: str = name) -> None:
            x = args[0].detach()
            seen = x.abs().float().reshape(-1, x.shape[-1]).amax(dim=0)
            ranges[name] = seen if name not in ranges else torch.maximum(ranges[name], seen)

        hooks.append(module.register_forward_pre_hook(record))
    if held.tokenizer is not None:
        prompts = [held.tokenizer.encode(t, add_special_tokens=False) for t in CALIBRATION]
    else:
        g = torch.Generator().manual_seed(2)
        vocab = held.model.spec.vocab_size
        prompts = [torch.randint(0, vocab, (48,), generator=g).tolist() for _ in range(3)]
    run = held.run()
    try:
        for ids in prompts:
            run(ids[: held.limit])
    finally:
        for h in hooks:
            h.remove()
    return ranges


def int8_dense_path(held: HeldOut, binding: bool, key: tuple) -> str:
    """Calibrate, time and judge the int8 W8A8 copies (the module docstring); returns the
    banner's words ("" where the copies cannot be made here)."""
    timed = measure.measure_int8_dense(held.model, key, calibrate(held))
    if timed:
        log.info("GGUF dense path: %s", timed)
    judged = judge_int8_dense(held, binding, (*key, "int8 prefill"))
    return "; ".join(part for part in (timed, judged) if part)


def _projection(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _leaving_order(names: set[str]) -> list[str]:
    return sorted(names, key=lambda n: LEAVE_FIRST.index(n) if n in LEAVE_FIRST else -1)


def judge_int8_dense(held: HeldOut, binding: bool, key: tuple | None = None) -> str:
    """Which projections keep their int8 copies (the module docstring, stage 3); `binding`
    (auto) applies the bar, otherwise every copy serves and the words say what it measured.
    Returns the banner's words ("" where no copy was kept by the timing)."""
    weights = [
        (_projection(name), w) for name, w in gguf_linear.served_weights(held.model) if w.int8
    ]
    if not weights:
        return ""
    if key is not None and key in _JUDGED:
        kept, text = _JUDGED[key]
    else:
        kept, text = _judge(held, weights, binding)
        if key is not None:
            _JUDGED[key] = (kept, text)
    for projection, w in weights:
        if projection not in kept:
            w.int8, w.int8_min_rows = None, 1 << 30
    log.info("GGUF dense path: %s", text)
    return text


def _judge(
    held: HeldOut, weights: list[tuple[str, GGUFWeight]], binding: bool
) -> tuple[tuple[str, ...], str]:
    chosen = [(w.int8_min_rows, w.kernel_max_rows) for _, w in weights]
    logits = held.logits()
    tried = []
    try:
        for _, w in weights:  # the held-out prompts are short: every row through the dense path
            w.int8_min_rows, w.kernel_max_rows = 1 << 30, 0
        reference = logits()
        order = _leaving_order({p for p, _ in weights})
        while order:
            for projection, w in weights:
                w.int8_min_rows = 1 if projection in order else 1 << 30
            top1, cosine = agreement(reference, logits())
            passed = top1 >= INT8_ACTIVATION_TOP1 and cosine >= INT8_ACTIVATION_COSINE
            tried.append(f"{'+'.join(order)}: top-1 {top1:.2f}, cosine {cosine:.4f}")
            if passed or not binding:
                break
            order = order[1:]
    finally:
        for (_, w), (rows, kernel) in zip(weights, chosen):
            w.int8_min_rows, w.kernel_max_rows = rows, kernel
    measured = (
        f"vs the float GEMM on {len(reference)} held-out positions, bar "
        f"{INT8_ACTIVATION_TOP1} / {INT8_ACTIVATION_COSINE}: {'; '.join(tried)}"
    )
    if not order:
        return (), f"int8 prefill refused by the accuracy judge ({measured})"
    return tuple(order), f"int8 prefill serves on {', '.join(order)} ({measured})"
