"""The GGUF block kernel by row count on the default model: one pass over the decoder's weights in
forward order, and over the lm_head apart, through the few-row kernel (the path a decode or verify
step of that many rows takes), best of several passes. Where the serving dtype is bf16 on a CPU
with AVX512-BF16 this is the pair-dot kernel (kernels/gguf_q8_bf16.h); float32 takes the FMA one.

    python bench/gguf_rows.py                    # --dtype auto
    python bench/gguf_rows.py --dtype float32    # the FMA kernel
    KVSERVE_CPP_MARCH=x86-64-v3 python bench/gguf_rows.py --dtype float32   # its AVX2 build

Prints ms per pass by rows, and each extra row's cost over one row's: a verify step of 1 + k rows
pays that for its k drafts.
"""

from __future__ import annotations

import argparse

from engine import LLM
from models.linear import gguf_linear, measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", default="1,2,3,4,6,8,12,16")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, num_speculative_tokens=0)
    groups = gguf_linear.weight_groups(llm.engine.model)
    print(f"dtype {llm.engine.info.dtype}; ms per pass (extra rows' ms each over 1 row)")
    for name, weights in groups.items():
        one = 0.0
        for rows in (int(r) for r in args.rows.split(",")):
            ms = measure._best_times(weights, ["kernel"], rows)[0] * 1e3
            one = one or ms
            extra = f"  (+{(ms - one) / (rows - 1):.2f} a row)" if rows > 1 else ""
            print(f"{name:<16} {rows:>3} rows {ms:7.2f} ms{extra}")


if __name__ == "__main__":
    main()
