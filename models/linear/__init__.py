"""Linear layers and their weight formats, as vLLM's `quant_method`: a model builds `Linear`
(layer.py) and calls it; what multiplies is the layer's *method*, one small object per format,
chosen at load, and where a weight has several, which serves a step is chosen per row bucket
from what the startup measurement (measure.py) found on this CPU:

- dense.py: a float weight multiplied as it is (`DensePlain`: MKL's skinny GEMM) or from a
  oneDNN-packed copy (`OneDNNPacked`), the latter from `packed_min_rows` rows (`DenseWeight`,
  `measure_packed_rows`);
- gguf_linear.py: GGUF Q4_0 / Q4_1 / Q8_0 blocks served as stored (`GGUFBlocks`: the block
  kernel on float or int8-rounded activations), a dense method above `kernel_max_rows`, and
  int8 rows (int8_prefill.py `Int8Weight`) from `int8_min_rows` (`GGUFWeight`;
  `measure_crossover`, `measure_int8_dense`);
- w8a8.py: int8 W8A8 through fbgemm (`--quantization int8`), after SmoothQuant;
- LoRA rides on top of whichever serves (models/lora.py `LoRAOnTop`: the base product once,
  each adapter's low-rank product on its rows).

decode_stack.py is the one fast path that spans layers: a decode step's whole stack in one C++
op where every layer's weights are GGUF blocks on the same kernel (`DecodeStack`). The C++
kernels live in `kernels/`, the room below; this package imports nothing else of kvserve's
but models' own leaves.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class LinearMethod(Protocol):
    """A linear layer's weight in one format (or a choice among formats by row count): it
    multiplies activations itself."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] in the serving dtype -> [..., out] in x's dtype, by the path this
        format takes for x's row count."""
        ...

    def rows(self, index: slice | torch.Tensor, part: Any) -> LinearMethod:
        """Output rows `index` as a method of their own (a tensor-parallel rank's part, a draft
        head's vocabulary), with this one's row buckets, for `part` (the layer over those rows,
        whose parameters hold their dense weight and bias)."""
        ...

    def pack(self) -> int:
        """Hold the copies its many-row path wants (a oneDNN-packed dense copy); returns the
        bytes added (0: none)."""
        ...


def served_format(method: LinearMethod) -> LinearMethod:
    """The format under any methods on top (LoRA's: each names the one below `base`)."""
    while hasattr(method, "base"):
        method = method.base
    return method
