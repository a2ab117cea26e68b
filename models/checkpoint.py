"""What the checkpoint loaders share: tensors in `LlamaForCausalLM`'s own parameter names.

The model's names are its `state_dict()`'s ("layers.3.qkv_proj.weight"), and it fuses what
checkpoints keep apart: `qkv_proj` holds [q ; k ; v] rows (q only, in a layer that reads another
layer's KV) and `gate_up_proj` [gate ; up], one matmul each. Each loader (loader.py for HF
directories, gguf_loader.py, openelm.py) renames its tensors to those names; a slice of a fused
weight also names its part ("k"), and `fuse_parts` joins a weight's parts once all of them have
arrived (checkpoints store tensors in any order, and a layer's may straddle shards).

Kept apart from the loaders so that each can import it without importing another.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from models.spec import ModelSpec

# The parts of each fused parameter, in row order.
FUSED_PARTS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}

# (model parameter name, part of a fused parameter or None, tensor)
Part = tuple[str, str | None, torch.Tensor]


def to_tensor(array: np.ndarray) -> torch.Tensor:
    """A float32, C-ordered torch copy of `array` (GGUF data is a read-only memory map)."""
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def fuse_parts(
    spec: ModelSpec, tensors: Iterable[Part], complete: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, part, tensor) -> (name, tensor): a tensor without a part passes through; the parts
    of a fused parameter wait until all have arrived, then go out concatenated in row order. A
    layer that reads another layer's KV has no k/v rows: its k and v parts, if saved, are
    dropped. Raises if a fused parameter got some of its parts but not all (unless not
    `complete`: then such a parameter is left out)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, part, tensor in tensors:
        if part is None:
            yield name, tensor
            continue
        parts = _parts_of(spec, name)
        if part not in parts:
            continue  # k/v of a KV-sharing layer
        got = pending.setdefault(name, {})
        got[part] = tensor
        if len(got) == len(parts):
            del pending[name]
            yield name, torch.cat([got[p] for p in parts])
    # a fused parameter none of whose parts arrived is reported by the model as missing
    if complete:
        refuse_missing(
            f"{n} ({p})" for n, got in pending.items() for p in _parts_of(spec, n) if p not in got
        )


def copy_named(
    params: dict[str, torch.Tensor], weights: Iterable[tuple[str, torch.Tensor]], tied_head: bool
) -> set[str]:
    """Copy each (name, tensor) of `weights` into the model's tensor `params[name]` (an integer
    one, such as DeepSeek V4's hash routing table, takes the values rounded); the names copied.
    With `tied_head` an `lm_head.weight` is skipped: the head is the embedding. Raises on a name
    or shape the model does not have."""
    seen: set[str] = set()
    for name, tensor in weights:
        if name == "lm_head.weight" and tied_head:
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected tensor {name}")
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {list(tensor.shape)}, model {list(param.shape)}"
            )
        param.data.copy_(tensor.round() if not param.dtype.is_floating_point else tensor)
        seen.add(name)
    return seen


def refuse_missing(missing: Iterable[str]) -> None:
    """Raise, naming a few of them, if the checkpoint lacks any of these tensors."""
    names = sorted(missing)
    if names:
        raise ValueError(f"checkpoint lacks {len(names)} tensors, e.g. {names[:4]}")


def _parts_of(spec: ModelSpec, name: str) -> tuple[str, ...]:
    """The parts of fused parameter `name` ("layers.3.qkv_proj.weight") in this model."""
    parts = name.split(".")  # layers.3.qkv_proj.weight, layers.3.moe.experts.5.gate_up_proj.weight
    idx, module = parts[1], parts[-2]
    if module == "qkv_proj":
        i = int(idx)
        if spec.kv_group_owner(spec.layers[i].kv_group) != i:
            return ("q",)
        if spec.layers[i].k_eq_v:  # values from the key projection: no v rows
            return ("q", "k")
    return FUSED_PARTS[module]
