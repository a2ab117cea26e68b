"""LoRA adapters on the decoder's projections: the weights, read from a PEFT directory or a GGUF
LoRA file into the model's own fused names, and one step's low-rank updates over rows of many
adapters.

An adapter changes `y = x W^T` of a targeted projection into `y + s (x A^T) B^T` (A [r, in],
B [out, r], s = lora_alpha / r, or / sqrt(r) under rsLoRA). The model fuses q/k/v into
`qkv_proj` and gate/up into `gate_up_proj` (models/checkpoint.py), so an adapter's parts of one
fused projection are fused too: their A stacked ([r_q + r_k + r_v, in]: one matmul for x A^T)
and their B placed block-diagonally in [out, r_q + r_k + r_v] (a part the adapter does not
target is zero rows), with s folded into B at load. Each targeted projection serves through
`LoRAOnTop`, a linear method over whichever format serves the base weight (`enable_lora`): the
base product runs once for every row of the step; then each adapter's two small matmuls run on
its own rows (what Punica's and S-LoRA's grouped kernels do with one launch; here one pair of
GEMMs per adapter and projection, and the rows of an adapter are a slice when they are
contiguous). The step's rows reach the methods through `StepAdapters`, which the model sets for
a forward (as vLLM's punica wrapper is), so a layer calls its projections without them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.checkpoint import FUSED_PARTS
from models.linear import LinearMethod
from models.linear.layer import Linear
from models.spec import ModelSpec

MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# PEFT's module names (the HF model's) -> (the model's projection, part of it or None: whole)
PEFT_TARGETS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "qkv_proj": ("qkv_proj", None),  # Phi-3's fused projections
    "o_proj": ("o_proj", None),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", None),
}
# llama.cpp's tensor names in a GGUF LoRA ("blk.N.attn_q.weight.lora_a")
GGUF_TARGETS: dict[str, tuple[str, str | None]] = {
    "attn_q": ("qkv_proj", "q"),
    "attn_k": ("qkv_proj", "k"),
    "attn_v": ("qkv_proj", "v"),
    "attn_qkv": ("qkv_proj", None),
    "attn_output": ("o_proj", None),
    "ffn_gate": ("gate_up_proj", "gate"),
    "ffn_up": ("gate_up_proj", "up"),
    "ffn_down": ("down_proj", None),
}
_PEFT_KEY = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.[\w-]+)?\.weight"
)
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


class LoRAError(ValueError):
    """An adapter this model cannot serve: the message says what and where."""


@dataclass(frozen=True, slots=True)
class LoRAProjection:
    """One projection's update, stored transposed for `x @ a_t @ b_t`: `a_t` [in, R] (A^T),
    `b_t` [R, out] ((s B)^T)."""

    a_t: torch.Tensor
    b_t: torch.Tensor


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """An adapter in the model's names: per layer, projection -> its update."""

    rank: int  # the largest rank of any part
    layers: tuple[dict[str, LoRAProjection], ...]
    fingerprint: str  # sha256 of the scaled tensors: the adapter's identity in the KV cache
    nbytes: int
    targets: tuple[str, ...]  # the projections (and parts) it changes, for the banner


@dataclass(frozen=True, slots=True)
class LoRARows:
    """One step's adapters and the rows of the flat batch each serves (a slice where they are
    contiguous, else an index); rows of the base model are in no group."""

    groups: tuple[tuple[LoRAWeights, slice | torch.Tensor], ...]

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> torch.Tensor:
        """`out` (the base projection of `x`) plus each adapter's update on its rows, in place."""
        for weights, rows in self.groups:
            p = weights.layers[layer].get(module)
            if p is None:
                continue
            if isinstance(rows, slice):
                out[rows].addmm_(x[rows] @ p.a_t, p.b_t)
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ p.a_t) @ p.b_t)
        return out


class StepAdapters:
    """The adapters of the step being run and their rows, shared by every `LoRAOnTop` of a
    model: set for one forward (`serving`), None between them and in steps without adapters."""

    def __init__(self) -> None:
        self.rows: LoRARows | None = None
        self.enabled = False  # projections serve through LoRAOnTop (`enable_lora`)

    @contextlib.contextmanager
    def serving(self, rows: LoRARows | None) -> Iterator[None]:
        if rows is not None and not self.enabled:
            raise ValueError(
                "LoRA rows for a model whose projections take no adapters (enable_lora at load)"
            )
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None


@dataclass(slots=True)
class LoRAOnTop:
    """A linear method on top of `base` (whichever format serves the projection): the base
    product for every row, then each of the step's adapters' update on its own rows."""

    base: LinearMethod
    step: StepAdapters
    layer: int
    module: str  # the projection's name in MODULES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = self.step.rows
        return out if rows is None else rows.add(out, x, self.layer, self.module)

    def rows(self, index: slice | torch.Tensor, part: object) -> LinearMethod:
        raise ValueError("a projection with LoRA adapters is not cut by rows")

    def pack(self) -> int:
        return self.base.pack()


def enable_lora(layers: nn.ModuleList, step: StepAdapters) -> None:
    """Serve each decoder projection an adapter may target (MODULES) through `LoRAOnTop` over
    the method chosen for it at load. Call once the weights' methods are final."""
    for idx, layer in enumerate(layers):
        for module in MODULES:
            linear = getattr(layer, module, None)
            if isinstance(linear, Linear) and not isinstance(linear.method, LoRAOnTop):
                linear.method = LoRAOnTop(linear.method, step, idx, module)
    step.enabled = True


def projection_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, list[tuple[str, int]]]]:
    """Per projection of `layer`: (input width, [(part, output rows)] in row order); a layer
    that reads another layer's KV has only q, a mixture-of-experts layer no FFN projections."""
    lay = spec.layers[layer]
    q, kv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
    writes_kv = spec.kv_group_owner(lay.kv_group) == layer
    # no v rows where values are the key projection (Gemma 4's k_eq_v layers)
    kv_parts = ("k",) if lay.k_eq_v else ("k", "v")
    kv_parts = kv_parts if writes_kv else ()
    h = spec.hidden_size
    shapes = {
        "qkv_proj": (h, [("q", q)] + [(p, kv) for p in kv_parts]),
        "o_proj": (q, [("", h)]),
    }
    if not lay.num_experts:
        shapes["gate_up_proj"] = (
            h,
            [("gate", lay.intermediate_size), ("up", lay.intermediate_size)],
        )
        shapes["down_proj"] = (lay.intermediate_size, [("", h)])
    return shapes


def load_lora(path: str, spec: ModelSpec, dtype: torch.dtype, max_rank: int) -> LoRAWeights:
    """An adapter from a PEFT directory (adapter_config.json + adapter_model.safetensors or
    .bin) or a GGUF LoRA file, checked against `spec` (by its tensors' shapes, not by the base
    model its config names). Raises LoRAError saying what does not fit."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        parts = _gguf_parts(p, spec)
    elif p.is_dir():
        parts = _peft_parts(p)
    else:
        raise LoRAError(f"{path}: not a PEFT adapter directory or a .gguf LoRA file")
    return fuse(parts, spec, dtype, max_rank)


# (layer, projection, part or None, A [r, in], B [out, r] scaled)
Part = tuple[int, str, str | None, torch.Tensor, torch.Tensor]


def _peft_parts(root: Path) -> list[Part]:
    config_file = root / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"{root}: no adapter_config.json")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAError(f"{config_file}: not JSON ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{root}: a {cfg.get('peft_type')} adapter, not LoRA")
    for key, why in (("use_dora", "DoRA's magnitude vectors"), ("fan_in_fan_out", "Conv1D")):
        if cfg.get(key):
            raise LoRAError(f"{root}: {key} ({why}) is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{root}: bias={cfg['bias']!r}: only adapters without biases are served")
    if cfg.get("modules_to_save"):
        raise LoRAError(
            f"{root}: modules_to_save {cfg['modules_to_save']}: whole modules trained beside the "
            "adapter are not supported"
        )
    tensors = _read_tensors(root)
    r, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    parts = []
    for (layer, name), ab in _paired(tensors, _PEFT_KEY, PEFT_TARGETS, root).items():
        module = f"model.layers.{layer}.{name}"
        rank = int(_pattern(rank_pattern, module, r))
        scale = float(_pattern(alpha_pattern, module, alpha))
        scale /= math.sqrt(rank) if cfg.get("use_rslora") else rank
        if ab["A"].shape[0] != rank:
            raise LoRAError(
                f"{root}: layer {layer} {name}: lora_A has rank "
                f"{ab['A'].shape[0]}, the config says {rank}"
            )
        own, part = PEFT_TARGETS[name]
        parts.append((layer, own, part, ab["A"].float(), ab["B"].float() * scale))
    return parts


def _paired(
    tensors: dict[str, torch.Tensor], key: re.Pattern, targets: dict, where: Path
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """(layer, module name) -> {"A": ..., "B": ...}, in layer order; LoRAError for a tensor
    of no projection the decoder has, or a lone A or B."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = key.fullmatch(name)
        if m is None or m[2] not in targets:
            raise LoRAError(f"{where}: tensor {name}: no projection of the decoder to adapt")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3].upper()] = tensor
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"{where}: layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}"
            )
    return dict(sorted(pairs.items()))


def _pattern(patterns: dict, module: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module name's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    st, binary = root / "adapter_model.safetensors", root / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file

            return load_file(str(st))
        if binary.is_file():
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged file is the adapter's error
        raise LoRAError(f"{root}: cannot read the adapter's tensors ({e})") from None
    raise LoRAError(f"{root}: no adapter_model.safetensors or adapter_model.bin")


def _gguf_parts(path: Path, spec: ModelSpec) -> list[Part]:
    from models.gguf_loader import gguf_lora_tensors

    meta, tensors = gguf_lora_tensors(str(path), spec)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoRAError(
            f"{path}: not a GGUF LoRA adapter (general.type {meta.get('general.type')!r})"
        )
    alpha = meta.get("adapter.lora.alpha")
    parts = []
    for (layer, name), ab in _paired(tensors, _GGUF_KEY, GGUF_TARGETS, path).items():
        rank = ab["A"].shape[0]
        scale = float(alpha) / rank if alpha else 1.0  # llama.cpp: no alpha means scale 1
        own, part = GGUF_TARGETS[name]
        parts.append((layer, own, part, ab["A"], ab["B"] * scale))
    return parts


def fuse(parts: list[Part], spec: ModelSpec, dtype: torch.dtype, max_rank: int) -> LoRAWeights:
    """Per-part updates joined per fused projection (A stacked, B block-diagonal), checked
    against the model's shapes and the rank limit."""
    if not parts:
        raise LoRAError("the adapter has no LoRA tensors")
    grouped: dict[tuple[int, str], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for layer, module, part, a, b in parts:
        if not 0 <= layer < spec.num_layers:
            raise LoRAError(f"layer {layer}: the model has {spec.num_layers} layers")
        shapes = projection_shapes(spec, layer)
        if module not in shapes:
            raise LoRAError(
                f"layer {layer} {module}: a mixture-of-experts FFN (experts are not adapted)"
            )
        rank = max(rank, a.shape[0])
        if a.shape[0] > max_rank:
            raise LoRAError(
                f"layer {layer} {module}: rank {a.shape[0]} exceeds --max-lora-rank {max_rank}"
            )
        grouped.setdefault((layer, module), {})[part or ""] = (a, b)
    layers: list[dict[str, LoRAProjection]] = [{} for _ in range(spec.num_layers)]
    digest, nbytes, targets = hashlib.sha256(), 0, set()
    for (layer, module), got in sorted(grouped.items()):
        width, rows = projection_shapes(spec, layer)[module]
        out = sum(n for _, n in rows)
        if "" in got:  # the whole projection: a plain one, or one a checkpoint fuses (Phi-3)
            if len(got) > 1:
                raise LoRAError(f"layer {layer} {module}: both whole and per-part updates")
            a_cat, b_cat = got[""]
            _check_shapes(layer, module, a_cat, b_cat, width, out)
            targets.add(module)
        else:
            stray = set(got) - set(FUSED_PARTS.get(module, ()))
            if stray:
                raise LoRAError(f"layer {layer} {module}: no parts {sorted(stray)}")
            present = [(name, n) for name, n in rows if name in got]
            if not present:
                continue  # only k/v of a layer that reads another layer's KV
            for name, n in present:
                _check_shapes(layer, f"{module} {name}", *got[name], width, n)
            a_cat = torch.cat([got[name][0] for name, _ in present])
            b_cat = torch.zeros(out, a_cat.shape[0])
            row = col = 0
            for name, n in rows:
                if name in got:
                    b = got[name][1]
                    b_cat[row : row + n, col : col + b.shape[1]] = b
                    col += b.shape[1]
                    targets.add(f"{module}.{name}")
                row += n
        proj = LoRAProjection(a_cat.t().to(dtype).contiguous(), b_cat.t().to(dtype).contiguous())
        for source, served in ((a_cat, proj.a_t), (b_cat, proj.b_t)):
            digest.update(source.float().contiguous().numpy().tobytes())
            nbytes += served.numel() * served.element_size()
        digest.update(f"{layer}.{module}".encode())
        layers[layer][module] = proj
    return LoRAWeights(rank, tuple(layers), digest.hexdigest()[:32], nbytes, tuple(sorted(targets)))


def _check_shapes(
    layer: int, where: str, a: torch.Tensor, b: torch.Tensor, width: int, rows: int
) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or tuple(b.shape) != (rows, a.shape[0]):
        raise LoRAError(
            f"layer {layer} {where}: A {list(a.shape)}, B {list(b.shape)}; the model needs "
            f"A [r, {width}] and B [{rows}, r] (an adapter for another base model?)"
        )


def rows_of(
    spans: list[tuple[object, int, int]], device: torch.device
) -> list[tuple[object, slice | torch.Tensor]]:
    """(key, first row, rows) spans of the flat batch -> per key, its rows: a slice where they
    are one contiguous run, else an index tensor; keys in first-seen order."""
    by_key: dict[int, tuple[object, list[tuple[int, int]]]] = {}  # by id: keys need no hash
    for key, start, n in spans:
        runs = by_key.setdefault(id(key), (key, []))[1]
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + n)
        else:
            runs.append((start, start + n))
    out: list[tuple[object, slice | torch.Tensor]] = []
    for key, runs in by_key.values():
        if len(runs) == 1:
            out.append((key, slice(*runs[0])))
        else:
            index = torch.cat([torch.arange(s, e) for s, e in runs]).to(device)
            out.append((key, index))
    return out
