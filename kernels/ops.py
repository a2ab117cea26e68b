"""Every C++ op kvserve builds, declared once: its extension name, its source and the headers it
includes (all beside this file), and the ops it calls by name. A handle's `load()` is the
compiled `torch.ops.<name>` namespace, or None where it cannot be built (kernels/build.py); the
code that calls an op (a layer, an attention backend, the sampler) imports its handle from here
and keeps its PyTorch fallback.

The names are the extensions' names (`TORCH_LIBRARY(<name>, m)` in each source) and part of
what a build is looked up by: renaming one orphans every build made before it.
"""

from __future__ import annotations

from pathlib import Path

from kernels.build import CppOps

_HERE = Path(__file__).parent


def _op(name: str, source: str, *headers: str, needs: tuple[CppOps, ...] = ()) -> CppOps:
    return CppOps(f"kvserve_{name}", _HERE / source, tuple(_HERE / h for h in headers), needs)


# models/layers.py: residual add + RMSNorm and SiLU x up, fused (`.add_rms_norm`, `.silu_mul`)
CPU_FUSED = _op("cpu_fused", "cpu_fused.cpp")
# models/linear/gguf_linear.py: the GGUF block kernel on the blocks as stored (`.linear`,
# `.dequantize`)
GGUF = _op("gguf", "gguf_linear.cpp")
# models/linear/gguf_linear.py: the kernels on the interleaved copy, float and int8 activations
# (`.repack`, `.linear_float`, `.linear`, `.lanes`: 0 without AVX2)
GGUF_Q8 = _op("gguf_q8", "gguf_q8.cpp", "gguf_q8_isa.h", "gguf_q8_bf16.h")
# models/linear/int8_prefill.py: int8 rows for `torch._int_mm` and their scaling back
# (`.quantize_rows`, `.scale_rows`)
INT8_ROWS = _op("int8_rows", "int8_rows.cpp")
# engine/attention (the torch backend): paged decode attention, and rotary + KV write + decode
# in one call (`.paged_decode`, `.rope_write`, `.rope_write_decode`), on float32, bf16 or int8
# caches
CPU_DECODE = _op("cpu_decode", "cpu_decode.cpp", "kv_int8.h", "cpu_simd.h", "decode_attend.h")
# engine/attention/cpu_prefill.py: paged prefill flash attention (`.paged_prefill`,
# `.simd_width`: 0 without AVX2, `.bf16_dot`)
CPU_PREFILL = _op(
    "cpu_prefill", "cpu_prefill.cpp", "cpu_prefill_blocks.h", "cpu_simd.h", "kv_int8.h"
)
# engine/grammar/token_bitmask.py: a grammar's token bitmask applied to logits rows (`.apply_`)
TOKEN_BITMASK = _op("token_bitmask", "token_bitmask.cpp")
# models/linear/decode_stack.py: a decode step's whole decoder stack in one op (`.forward`). It
# calls the ops above through the dispatcher by name (decode_stack.cpp's `kernel<...>("...")`):
# those are its needs, so loading it loads them and the edge is declared here, not found at run
# time. GGUF_Q8's kernels are called only for weights on the interleaved copy, but it builds
# wherever the others do (its vector paths are compiled out without AVX2): needed like them.
DECODE_STACK = _op("decode_stack", "decode_stack.cpp", needs=(CPU_FUSED, GGUF, GGUF_Q8, CPU_DECODE))

# models/deepseek_v4_mix.py and models/deepseek_v4_attention.py: DeepSeek V4's hyper-connection
# mixing (`.hc_pre`, `.hc_post`) and its decode rows' window + compressed/sparse attention
# (`.sparse_decode`), float32
DEEPSEEK_V4 = _op("deepseek_v4", "deepseek_v4.cpp")

# every op, each after the ops it needs (scripts/build_ops.py builds them all)
ALL = (
    CPU_FUSED,
    GGUF,
    GGUF_Q8,
    INT8_ROWS,
    CPU_DECODE,
    CPU_PREFILL,
    TOKEN_BITMASK,
    DECODE_STACK,
    DEEPSEEK_V4,
)
BY_NAME = {op.name: op for op in ALL}
