"""Weights at load: a GGUF's blocks served as stored (`serve_gguf_blocks`, before packing), and
weights quantized at load and measured before they serve (after the attention backend's warm-up,
through the same plan + forward, writing KV only into blocks no request owns).

`--quantization int4 | int8wo`: every linear layer's weight rounded to ggml blocks (Q4_1, Q8_0; the
lm_head Q8_0) and served by the GGUF block kernel (models/linear/gguf_linear.py), activations at the
serving dtype. `--quantization int8`: smooth the float model on calibration text (SmoothQuant, so
per-tensor activation quantization keeps its accuracy), then give its linear layers int8 weights
(models/linear/w8a8.py).

The result is measured before it serves: the float and quantized models' logits over held-out text
(`HELD_OUT`, none of it calibration) give top-1 agreement and mean cosine, printed in the kernel
matrix. Weight-only formats warn below `WARN_TOP1` (bf16, a format users accept, agrees with float32
on ~97% of SmolLM2's positions; 0.9 is the bar the bf16 tests hold it to) and refuse below
`REFUSE_TOP1` (more than a third of next tokens changed is another model). int8 W8A8 is accurate or
refused, with no warning band: on a CPU without VNNI fbgemm's activations drop to 7 bits (Zen 3, and
`FBGEMM_ENABLE_INSTRUCTIONS=AVX2`), per-tensor ranges then crush a prompt's ordinary tokens under
its first token's outliers (SmolLM2: top-1 0.81, and one prompt's last logits at cosine 0.72), and
such a server would answer differently from the model it names; it refuses, naming the measurement
and `int8wo` (Q8_0 weights, llama.cpp's int8 activations) as what serves there. `--gguf-
int8-prefill`: GGUF weights' dense path on smoothed int8 W8A8 copies, calibrated, timed and judged
by projection in engine/weights/int8_dense.py. Everything measured is
deterministic (fixed calibration and held-out text, a fixed probe): a build gives the same figures
on every start of the same CPU and settings."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.attention.matrix import dtype_name
from engine.runner.step_inputs import step_metadata
from models.gguf_loader import gguf_blocks
from models.linear import gguf_linear, measure
from models.linear.w8a8 import (
    CALIBRATION,
    input_ranges,
    needs_reduce_range,
    quantize_linears,
    smooth,
)
from models.llama import LlamaForCausalLM
from models.spec import ModelSpec
from models.tokenizer import Tokenizer
from models.tp_plan import RankShard

log = logging.getLogger("kvserve.int8")

# Held-out text for the accuracy check: none of it is in CALIBRATION.
HELD_OUT = [
    "The mitochondria is the part of the cell that produces most of its chemical energy.",
    "for i in range(10):\n    total += values[i] * weights[i]\nprint(total / len(values))",
    "In 1969, Neil Armstrong became the first person to walk on the surface of the Moon.",
    "Dear team, the meeting moves to Thursday at 3 pm; please bring the budget figures.",
]
WARN_TOP1 = 0.90
REFUSE_TOP1 = 0.67
# int8 activations (--gguf-int8-activations auto) serve only where the model on them agrees with
# the same blocks on float activations at least this well over HELD_OUT. llama.cpp itself (whose
# numerics these are) on the shipped SmolLM2 Q4_1 agrees with kvserve's exact path at 0.988 of
# the 86 held-out positions (bench/int8_agreement.py, Zen 5): the bar allows ~3 more flips than
# that, and a cosine below 0.99 is a model whose logits moved, not one near-tie
INT8_ACTIVATION_TOP1 = 0.95
INT8_ACTIVATION_COSINE = 0.99


def agreement(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean cosine) of two [positions, vocab] logit tensors."""
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1).mean().item()
    return top1, cosine


def forward_fn(
    model: LlamaForCausalLM, backend: AttentionBackend, block_size: int, device: torch.device
) -> Callable[[list[int]], torch.Tensor]:
    """A prompt's final hidden rows, through the plan + forward, writing KV only into the
    pool's first blocks (no request owns any yet at startup)."""

    def run(ids: list[int]) -> torch.Tensor:
        table = list(range(-(-len(ids) // block_size)))
        positions, meta = step_metadata([(table, 0, len(ids))], block_size, device)
        return model(torch.tensor(ids, device=device), positions, backend.plan(meta))

    return run


def held_out_logits(
    model: LlamaForCausalLM,
    run: Callable[[list[int]], torch.Tensor],
    tokenizer: Tokenizer | None,
    limit: int,
) -> Callable[[], torch.Tensor]:
    """A function giving the model's logits at every position of HELD_OUT (random ids without a
    tokenizer), for measuring a quantization before it serves."""
    if tokenizer is not None:
        held_out = [tokenizer.encode(t, add_special_tokens=False)[:limit] for t in HELD_OUT]
    else:
        g = torch.Generator().manual_seed(1)
        vocab = model.spec.vocab_size
        held_out = [torch.randint(0, vocab, (min(48, limit),), generator=g).tolist()]

    def logits() -> torch.Tensor:
        return torch.cat([model.compute_logits(run(ids)) for ids in held_out])

    return logits


@dataclass(frozen=True, slots=True)
class HeldOut:
    """The warmed-up model that held-out text runs through before a quantization serves (its KV
    in the pool's first `num_blocks` blocks: no request owns any yet at startup)."""

    model: LlamaForCausalLM
    backend: AttentionBackend
    tokenizer: Tokenizer | None
    num_blocks: int
    block_size: int
    device: torch.device

    @property
    def limit(self) -> int:
        """Tokens of a prompt at most: what the blocks hold, up to 256."""
        return min(256, self.num_blocks * self.block_size)

    def run(self) -> Callable[[list[int]], torch.Tensor]:
        return forward_fn(self.model, self.backend, self.block_size, self.device)

    def logits(self) -> Callable[[], torch.Tensor]:
        """`held_out_logits` of the model as it is when called."""
        return held_out_logits(self.model, self.run(), self.tokenizer, self.limit)


def judge(
    method: str,
    reference: torch.Tensor,
    got: torch.Tensor,
    detail: str,
    refuse_below: float | None = None,
    instead: str = "the float model",
) -> str:
    """The accuracy line for the kernel matrix; raises below `refuse_below` (default
    REFUSE_TOP1), warns below WARN_TOP1 (see the module docstring)."""
    floor = REFUSE_TOP1 if refuse_below is None else refuse_below
    top1, cosine = agreement(reference, got)
    accuracy = (
        f"vs the unquantized model on {len(reference)} held-out positions: "
        f"top-1 agreement {top1:.2f}, logit cosine {cosine:.3f}"
    )
    if top1 < floor:
        raise ValueError(
            f"--quantization {method} is too inaccurate on this CPU ({accuracy}, {detail}; "
            f"below {floor}): serve {instead} instead"
        )
    if top1 < WARN_TOP1:
        log.warning("%s weights are inaccurate here: %s", method, accuracy)
        return f"{accuracy} -- WARNING: below {WARN_TOP1}, answers will differ visibly"
    return accuracy


@torch.inference_mode()
def quantize_model(
    held: HeldOut,
    alpha: float = 0.8,  # SmolLM2, alpha 0.5 / 0.65 / 0.8 / 0.9: top-1 0.88 / 0.86 / 0.93 / 0.88
) -> str:
    """Smooth, quantize, and describe the result for the kernel matrix."""
    model, tokenizer, limit = held.model, held.tokenizer, held.limit
    if tokenizer is not None:
        prompts = [tokenizer.encode(t, add_special_tokens=False)[:limit] for t in CALIBRATION]
    else:  # token ids only: a spread of ids stands in for text
        g = torch.Generator().manual_seed(0)
        vocab = model.spec.vocab_size
        prompts = [torch.randint(0, vocab, (min(64, limit),), generator=g).tolist()] * 4

    run, logits = held.run(), held.logits()
    smooth(model, input_ranges(model, run, prompts), alpha)
    reference = logits()  # smoothing computes the same function: this is the float model
    int8_bytes = quantize_linears(model)
    bits = 7 if needs_reduce_range() else 8
    why = f"{bits}-bit activations" + (" (fbgemm without VNNI)" if bits == 7 else "")
    instead = "--quantization int8wo (Q8_0 weights; int8 activations where the judge accepts them)"
    accuracy = judge("int8", reference, logits(), why, WARN_TOP1, instead)
    dtype = dtype_name(model.lm_head.weight.dtype)
    described = (
        f"int8 W8A8 dynamic (fbgemm, per-channel weights, SmoothQuant alpha {alpha} on "
        f"{sum(map(len, prompts))} calibration tokens; {int8_bytes / 2**20:.0f} MiB; {bits}-bit "
        f"activations by probe; lm_head {dtype}); {accuracy}"
    )
    log.info("weights: %s", described)
    return described


# --quantization -> the ggml format of the decoder's weights (the lm_head takes Q8_0: its logits
# set every token, and llama.cpp's own quantizations keep it at 6-8 bits too)
WEIGHT_ONLY = {"int4": "Q4_1", "int8wo": "Q8_0"}


@torch.inference_mode()
def quantize_weight_only(
    held: HeldOut,
    method: str,
    pack: bool,
    int8_activations: bool = False,
    q8_min_rows: int = 0,
    key: tuple | None = None,
) -> str:
    """Round every float linear weight to ggml blocks, measure the result on held-out text,
    and describe it for the kernel matrix (`key`: the crossover's memo, as in load_weights)."""
    model, logits = held.model, held.logits()
    reference = logits()
    fmt = WEIGHT_ONLY[method]
    held = gguf_linear.attach(model, gguf_linear.quantize_to_blocks(model, fmt))
    if pack:
        for w in gguf_linear.gguf_weights(model):
            w.pack()
    accuracy = judge(method, reference, logits(), f"{fmt} weights")
    dtype = model.embed_tokens.weight.dtype
    crossover = measure.measure_crossover(
        model, dtype, int8_activations, key, q8_min_rows=q8_min_rows
    )
    stored = ", ".join(f"{f} {size / 2**20:.0f} MiB" for f, size in sorted(held.items()))
    described = (
        f"weight-only {method}: ggml blocks rounded at load ({stored}; lm_head Q8_0); {accuracy}; "
        f"{crossover}"
    )
    log.info("weights: %s", described)
    return described


def serve_gguf_blocks(
    model: LlamaForCausalLM,
    model_path: str,
    spec: ModelSpec,
    device: torch.device,
    shard: RankShard | None = None,
) -> tuple[str, bool]:
    """`--quantization auto` on a GGUF: its Q4_0/Q4_1/Q8_0 matrices served as stored (CPU, with
    the C++ kernel built). Returns what was done, for the kernel matrix's weights line, and
    whether any weight now takes the block kernel (its crossover is then to be measured)."""
    if not model_path.endswith(".gguf"):
        return "", False
    if device.type != "cpu":
        return "GGUF blocks dequantized (the block kernel is a CPU path)", False
    if gguf_linear.load() is None:
        return "GGUF blocks dequantized (the C++ block kernel could not be built)", False
    blocks = gguf_blocks(model_path, spec, gguf_linear.FORMATS)
    if spec.tie_word_embeddings and "embed_tokens.weight" in blocks:
        # the head multiplies by the embedding's blocks; lookups keep the dense embedding
        blocks["lm_head.weight"] = blocks.pop("embed_tokens.weight")
    if shard is not None:  # this rank's slices; a block a column cut would split stays dense
        cut = {}
        for name, (fmt, data) in blocks.items():
            part = shard.cut_blocks(name, data, gguf_linear.BLOCK_BYTES[fmt])
            if part is not None and part.numel():
                cut[name] = (fmt, part)
        blocks = cut
    held = gguf_linear.attach(model, blocks)
    if not held:
        return "", False
    stored = ", ".join(f"{fmt} {size / 2**20:.0f} MiB" for fmt, size in sorted(held.items()))
    copies = sum(
        w.kernel.interleaved.numel()
        for w in gguf_linear.gguf_weights(model)
        if w.kernel.interleaved is not None
    )
    kernel = (
        f"block kernel for few rows on an interleaved copy ({copies / 2**20:.0f} MiB)"
        if copies
        else "block kernel for few rows"
    )
    return f"GGUF blocks as stored ({stored}): {kernel}, dense GEMM above", True


# Judgements made in this process, by the caller's key (the weights and settings; see
# engine/build/weights.py weights_key): an engine built again on them reuses the verdict.
_JUDGED: dict[tuple, tuple[bool, str]] = {}


@torch.inference_mode()
def _int8_verdict(
    held: HeldOut,
    paths: tuple[Callable[[], None], Callable[[], None], Callable[[], None]],
    key: tuple | None,
    binding: bool,
    words: tuple[str, str, str],
) -> tuple[bool, str]:
    """Whether an int8 path keeps serving, and the banner's words for it: HELD_OUT's logits on
    the exact path against the int8 one at INT8_ACTIVATION_TOP1 / _COSINE (binding: `auto`),
    or the verdict `key` already has. `paths`: set the exact path, set the int8 one, restore
    what they set; `words`: what it is compared against, then the served and refused phrases."""
    if key is not None and key in _JUDGED:
        return _JUDGED[key]
    exact, int8, restore = paths
    against, served, refused = words
    logits = held.logits()
    try:
        exact()
        reference = logits()
        int8()
        top1, cosine = agreement(reference, logits())
    finally:
        restore()
    keep = not binding or (top1 >= INT8_ACTIVATION_TOP1 and cosine >= INT8_ACTIVATION_COSINE)
    measured = (
        f"vs {against} on {len(reference)} held-out positions: top-1 agreement {top1:.2f}, "
        f"logit cosine {cosine:.4f}"
    )
    bar = f"{INT8_ACTIVATION_TOP1} / {INT8_ACTIVATION_COSINE}"
    text = f"{served} ({measured})" if keep else f"{refused} ({measured}; below {bar})"
    if key is not None:
        _JUDGED[key] = (keep, text)
    return keep, text


def judge_int8_activations(held: HeldOut, binding: bool, key: tuple | None = None) -> str:
    """Where the startup probe chose the int8-activation kernel for some rows, measure what it
    costs: HELD_OUT through every weight's chosen kernel for every row (as decode runs them)
    against the same blocks on float activations (exact up to summation order). `binding`
    (auto): below INT8_ACTIVATION_TOP1 / _COSINE the int8 kernel is dropped and float
    activations serve. Returns the banner's words ("" when no weight chose it)."""
    weights = gguf_linear.gguf_weights(held.model)
    chosen = [(w.q8_max_rows, w.kernel_max_rows) for w in weights]
    if not any(q8 for q8, _ in chosen):
        return ""
    every_row = 1 << 30

    def exact() -> None:
        for w in weights:
            w.q8_max_rows, w.kernel_max_rows = 0, every_row

    def int8() -> None:
        for w, (q8, _) in zip(weights, chosen):
            w.q8_max_rows = every_row if q8 else 0

    def restore() -> None:
        for w, limits in zip(weights, chosen):
            w.q8_max_rows, w.kernel_max_rows = limits

    words = (
        "float activations",
        "int8 activations serve where faster",
        "int8 activations refused by the accuracy judge",
    )
    keep, text = _int8_verdict(held, (exact, int8, restore), key, binding, words)
    if not keep:
        for w in weights:
            w.q8_max_rows = 0
    log.info("GGUF block kernel: %s", text)
    return text
