"""`Linear`, the layer every model builds and calls: it holds the weight (and bias) as the
checkpoint loads it, and multiplies by its *method* (models/linear/__init__.py), chosen at load:
the dense weight as it is until packed (dense.py), or the weight's other format (`serve`: GGUF
blocks, int8 W8A8), with LoRA on top where adapters serve (models/lora.py)."""

from __future__ import annotations

import torch
from torch import nn

from models.linear import LinearMethod, served_format
from models.linear.dense import DensePlain, DenseWeight, can_pack


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.method: LinearMethod = DensePlain(self)

    @property
    def format(self) -> LinearMethod:
        """The method of the weight's format, under any on top of it (LoRA)."""
        return served_format(self.method)

    @property
    def dense(self) -> bool:
        """Whether the format is this layer's own dense weight (plain or packed)."""
        return isinstance(self.format, (DensePlain, DenseWeight))

    def _set_format(self, method: LinearMethod) -> None:
        """Serve the weight from `method`, under the methods on top of the current one."""
        top = self.method
        if not hasattr(top, "base"):
            self.method = method
            return
        while hasattr(top.base, "base"):
            top = top.base
        top.base = method

    def serve(self, method: LinearMethod) -> None:
        """Serve this layer from `method` (the weight in another format); the dense weight and
        its packed copy are dropped (a tied weight is kept by its other owner)."""
        self._set_format(method)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack(self) -> int:
        """Also hold the weight in oneDNN's blocked layout for matmuls of >= PACKED_MIN_ROWS
        rows (a GGUF weight: its dequantized copy). Call after the weights are final (a later
        weight change is not seen). Returns the bytes added."""
        if not self.dense:
            return self.format.pack()
        if not can_pack(self.weight):
            return 0
        self._set_format(DenseWeight.of(self))
        return self.weight.numel() * self.weight.element_size()

    def unpack(self) -> None:
        """Drop a packed copy (the weight is about to change: SmoothQuant folds factors in)."""
        if self.dense:
            self._set_format(DensePlain(self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method(x)

    def rows(self, index: slice | torch.Tensor) -> Linear:
        """A Linear over output rows `index` of this one (a slice: views of its weight or a GGUF
        weight's blocks; row ids: copies), packed again if this one is."""
        part = Linear(self.in_features, 0, bias=self.bias is not None)
        if self.bias is not None:
            part.bias = nn.Parameter(self.bias.detach()[index], requires_grad=False)
        if self.dense:
            part.weight = nn.Parameter(self.weight.detach()[index], requires_grad=False)
        part.method = self.method.rows(index, part)
        return part

    def load_rows(self, start: int, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy an HF-layout weight [out_rows, in] into output rows [start, start + out_rows)."""
        rows = weight.shape[0]
        self.weight.data[start : start + rows].copy_(weight)
        if bias is not None:
            assert self.bias is not None
            self.bias.data[start : start + rows].copy_(bias)


def pack_linears(module: nn.Module) -> int:
    """`Linear.pack` every linear layer under `module` (each weight once, tied ones too)."""
    return sum(m.pack() for m in module.modules() if isinstance(m, Linear))
