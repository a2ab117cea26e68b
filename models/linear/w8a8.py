"""int8 weights on CPU (`--quantization int8`): W8A8 dynamic through torch's fbgemm engine.

Each linear layer's weight is quantized once, per output channel and symmetric (scale =
max|w| / 127), and prepacked for fbgemm; at run time fbgemm quantizes the activations per call
(per tensor, asymmetric uint8), multiplies in int8 with VNNI where the CPU has it, and returns
float32. Chosen by measurement over the alternatives torch offers (SmolLM2's 30 layers of
weights, out of cache, 2 threads, Zen 5; `python bench/quant.py --kernels`): at 1 / 8 / 64 /
256 rows, fbgemm W8A8 5.6 / 7.2 / 28 / 94 ms, oneDNN bf16 10.8 / 15 / 43 / 137, float32 19 / 22
/ 83 / 267, `torch._weight_int8pack_mm` (weight-only) fastest at one row only, `torch._int_mm`
no faster than bf16.

The lm_head stays in the serving dtype (its logits set every token; vLLM's W8A8 schemes leave it
unquantized too). `reduce_range` (7-bit activations) is chosen by a startup probe rather than a
CPU flag: without VNNI, fbgemm's AVX2 kernel sums pairs of uint8 x int8 products in int16 and
can saturate; the probe multiplies a matrix built to saturate and keeps full range only if the
result is exact."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from models.linear.layer import Linear


@dataclass(frozen=True, slots=True)
class W8A8:
    """The W8A8 format: a weight (and bias) as fbgemm prepacked it."""

    packed: torch.Tensor  # fbgemm's prepacked weight (and bias)
    reduce_range: bool
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        y = torch.ops.quantized.linear_dynamic(xf, self.packed, self.reduce_range)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def rows(self, index: slice | torch.Tensor, part: object = None) -> W8A8:
        # the lm_head (the one layer a rank or a draft head cuts by rows) stays in the serving
        # dtype, and int8 W8A8 is refused under tensor parallelism
        raise ValueError("int8 W8A8 weights are not cut by rows")

    def pack(self) -> int:
        return 0  # fbgemm's prepacked weight is the only copy


def _quantize_per_channel(weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao;
        warnings.simplefilter("ignore")  # the fbgemm engine they feed is what measures fastest
        return torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)


def int8_weight(weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool) -> W8A8:
    b = bias.detach().float() if bias is not None else None
    packed = torch.ops.quantized.linear_prepack(_quantize_per_channel(weight), b)
    return W8A8(packed, reduce_range, weight.shape[0])


@lru_cache(maxsize=1)
def needs_reduce_range() -> bool:
    """True when full-range activations give a wrong product on this CPU (see module doc)."""
    torch.backends.quantized.engine = "fbgemm"
    k = 256
    x = torch.full((4, k), 8.0)
    x[:, 0] = -8.0  # sets the activation range: most values quantize to uint8 255
    w = torch.full((16, k), 1.0)  # every weight quantizes to int8 127
    exact = x @ w.t()
    got = int8_weight(w, None, reduce_range=False)(x)
    return not torch.allclose(got, exact, rtol=0.02, atol=1.0)


def can_quantize(device: torch.device) -> str | None:
    """None if int8 weights can run here, else why not."""
    if device.type != "cpu":
        return "int8 weights are a CPU path (fbgemm); on CUDA serve a bf16/fp16 checkpoint"
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm quantized engine"
    return None


# Calibration text for smoothing: prose, code, a list, dialogue, JSON and numbers, so each
# channel's activation range is seen on the kinds of text the model serves.
CALIBRATION = [
    "The history of the city begins with a small settlement on the river, where traders met "
    "to exchange salt, grain and cloth. Over the centuries it grew into a capital.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items)"
    " // 2\n    return merge(merge_sort(items[:mid]), merge_sort(items[mid:]))\n",
    "Shopping list:\n1. Apples (6)\n2. Whole-wheat bread\n3. Milk, 2 litres\n4. Coffee beans",
    "User: Can you help me plan a trip to Kyoto in April?\nAssistant: Of course! April is "
    "cherry blossom season, so book early. Here is a three-day plan.",
    '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "notes": null}',
    "Q3 revenue rose 12.4% to $8.91 billion; operating margin was 23%, up from 19.7%.",
]


@torch.inference_mode()
def input_ranges(model: nn.Module, run: Callable[[list[int]], None], prompts: list[list[int]]):
    """max |x| per input channel of every `Linear` in the decoder layers, over the prompts."""
    ranges: dict[Linear, torch.Tensor] = {}
    hooks = []

    def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(dim=0)
        old = ranges.get(module)  # type: ignore[call-overload]
        ranges[module] = seen if old is None else torch.maximum(old, seen)  # type: ignore[index]

    for layer in dense_layers(model):
        for linear in (layer.qkv_proj, layer.gate_up_proj, layer.down_proj):
            hooks.append(linear.register_forward_pre_hook(record))
    try:
        for ids in prompts:
            run(ids)
    finally:
        for h in hooks:
            h.remove()
    return ranges


def dense_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers with a dense FFN and their own q/k/v (what smoothing can fold into)."""
    return [lay for lay in model.layers if lay.moe is None and lay.qkv_proj is not None]


def smoothing(act: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-channel factor: divides activations, multiplies weight columns."""
    w = weight.detach().abs().float().amax(dim=0).clamp(min=1e-5)
    return (act.clamp(min=1e-5) ** alpha / w ** (1 - alpha)).clamp(min=1e-5)


def smooth(model: nn.Module, ranges: dict[Linear, torch.Tensor], alpha: float = 0.8) -> None:
    """Move activation outliers into the weights (SmoothQuant), exactly: for qkv and gate_up the
    factor is folded into the RMSNorm before them, for down_proj into the `up` rows of
    gate_up (its input is act(gate) * up). The float model computes the same function.
    Mixture-of-experts layers are left unsmoothed (one norm feeds many experts)."""
    for layer in dense_layers(model):
        for norm, linear in (
            (layer.input_layernorm, layer.qkv_proj),
            (layer.post_attention_layernorm, layer.gate_up_proj),
        ):
            s = smoothing(ranges[linear], linear.weight, alpha)
            norm.weight.data.div_(s.to(norm.weight.dtype))
            linear.weight.data.mul_(s.to(linear.weight.dtype))
        down, n = layer.down_proj, layer.down_proj.in_features
        s = smoothing(ranges[down], down.weight, alpha)
        layer.gate_up_proj.weight.data[n:].div_(s.to(down.weight.dtype)[:, None])
        down.weight.data.mul_(s.to(down.weight.dtype))
        for linear in (layer.qkv_proj, layer.gate_up_proj, down):
            linear.unpack()  # a packed copy holds the weight before smoothing


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Give every `Linear` under `model` (but those named in `skip`) int8 weights; their float
    weights are dropped (a tied weight is kept by its other owner). Returns the int8 bytes."""
    reduce_range = needs_reduce_range()
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.split(".")[-1] in skip:
            continue
        weight = int8_weight(module.weight, module.bias, reduce_range)
        module.serve(weight)
        total += weight.out_features * module.in_features
    return total
