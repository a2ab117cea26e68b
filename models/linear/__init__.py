"""Linear layers and their weight formats, as vLLM's `quant_method`: a model builds `Linear`
(dense.py) and calls it; what multiplies is the weight's *method*, one small object per format,
each choosing its own path per row bucket from what the startup measurement found on this CPU:

- dense.py: a float weight, plain torch (MKL's skinny GEMM) or a oneDNN-packed copy from
  `packed_min_rows` rows (`measure_packed_rows`);
- gguf.py: GGUF Q4_0 / Q4_1 / Q8_0 blocks served as stored: the block kernel (int8-rounded or
  float activations) up to `q8_max_rows` / `kernel_max_rows`, a dense GEMM above, int8 rows
  (int8_rows.py) from `int8_min_rows` (`measure_crossover`, `measure_int8_dense`);
- w8a8.py: int8 W8A8 through fbgemm (`--quantization int8`), after SmoothQuant;
- LoRA rides on any of them (models/lora.py: the base product once, each adapter's low-rank
  product on its rows).

decode_stack.py is the one fast path that spans layers: a decode step's whole stack in one C++
op where every layer's weights are GGUF blocks on the same kernel (`DecodeStack`). The C++
kernels live in `kernels/`, the room below; this package imports nothing else of kvserve's
but models' own leaves.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LinearMethod(Protocol):
    """A linear layer's weight in a format other than the dense one (`Linear.quant`): it holds
    the weight (and bias) and multiplies activations itself."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] in the serving dtype -> [..., out] in x's dtype, by the path this
        format takes for x's row count."""
        ...

    def rows(self, index: slice | torch.Tensor) -> LinearMethod:
        """Output rows `index` as a method of their own (a tensor-parallel rank's part, a draft
        head's vocabulary), with this one's row buckets."""
        ...

    def pack(self) -> int:
        """Hold the copies its many-row path wants (a oneDNN-packed dense copy); returns the
        bytes added (0: none)."""
        ...
