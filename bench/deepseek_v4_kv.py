"""DeepSeek V4's KV cache in kvserve's paged pool against an uncompressed cache of the same
attention, computed from the layout (models/deepseek_v4.py's KV groups), nothing allocated:

- KV bytes per token of one request at 1k, 8k, 32k, 128k and 1M tokens of context. Compressed:
  what the pool really holds for the request: every block of its compressed groups (CSA entries
  with the indexer's keys, HCA entries, and the compressor rows where the window does not cover
  them), and only the live blocks of its windowed groups (window keys, compressor rows).
  Uncompressed: one K=V head (head_dim values) per token per layer, for every token (a dense
  MQA cache of the same layers; a cache with separate K and V would hold twice that).
- How many concurrent 32k-token requests a fixed pool admits either way.
- With --time: decode step time at batch 1 and 16 at 8k context through the engine, the tiny V4
  against a dense Llama of the same hidden size, layers and heads (same run), and where the V4
  step's time goes (torch profiler, top ops).

    python -m bench.deepseek_v4_kv [--block-size 64] [--dtype-bytes 2] [--time]
"""

from __future__ import annotations

import argparse

from engine.kv.window import first_live_block
from models.deepseek_v4 import deepseek_v4_spec
from models.spec import ModelSpec

CSA, HCA, S = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
# the tiny model: tests/test_deepseek_v4.py runs it against transformers (importing it from here)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    num_experts_per_tok=2,
    n_routed_experts=4,
    layer_types=[CSA, HCA, S, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 32},
    sliding_window=16,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=8,
    partial_rotary_factor=0.25,
    max_position_embeddings=1 << 21,
    hc_mult=4,
)
CONTEXTS = (1 << 10, 8 << 10, 32 << 10, 128 << 10, 1 << 20)


def defaults() -> dict:
    """`DeepseekV4Config()`'s fields, as transformers 5.24 fills them in."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config().to_dict()


def request_bytes(spec: ModelSpec, context: int, block_size: int, size: float) -> int:
    """Bytes the pool holds for one request of `context` tokens (its next query at `context`)."""
    blocks = -(-context // block_size)
    assert spec.sliding_window is not None
    live = blocks - first_live_block(context, spec.sliding_window, block_size)
    return round(
        sum(
            g.block_values(block_size) * size * (live if g.windowed else blocks)
            for g in spec.group_specs
        )
    )


def dense_bytes(spec: ModelSpec, context: int, size: float) -> int:
    return round(context * sum(lay.num_kv_heads * lay.head_dim for lay in spec.layers) * size)


def by_group(spec: ModelSpec, context: int, block_size: int, size: float) -> str:
    out: dict[str, int] = {}
    for g in spec.group_specs:
        one = ModelSpec(
            spec.architecture,
            spec.vocab_size,
            spec.hidden_size,
            spec.layers,
            sliding_window=spec.sliding_window,
            group_specs=(g,),
        )
        out[g.role] = out.get(g.role, 0) + request_bytes(one, context, block_size, size)
    return ", ".join(f"{role} {b / context:.1f}" for role, b in out.items())


def layout_report(name: str, cfg: dict, block_size: int, size: float, pool: int) -> None:
    spec = deepseek_v4_spec(cfg, ())
    types = spec.extra["layer_types"]
    rates = spec.extra["compress_rates"]
    print(
        f"\n== {name}: {spec.num_layers} layers ({types.count(CSA)} CSA m={rates[CSA]}, "
        f"{types.count(HCA)} HCA m'={rates[HCA]}, {types.count(S)} sliding), window "
        f"{spec.sliding_window}, head_dim {spec.layers[0].head_dim}, block {block_size}, "
        f"{size:g} bytes a value; {len(spec.group_specs)} KV groups, "
        f"{spec.kv_block_bytes(block_size, size)} bytes a block across them"
    )
    print(
        f"{'context':>9} {'compressed B/tok':>17} {'uncompressed B/tok':>19} {'ratio':>7} "
        f"{'saved':>7}   compressed by group (B/tok)"
    )
    for ctx in CONTEXTS:
        ours, dense = request_bytes(spec, ctx, block_size, size), dense_bytes(spec, ctx, size)
        print(
            f"{ctx:>9} {ours / ctx:>17.1f} {dense / ctx:>19.1f} {ours / dense:>7.3f} "
            f"{1 - ours / dense:>7.1%}   {by_group(spec, ctx, block_size, size)}"
        )
    ctx = 32 << 10
    ours, dense = request_bytes(spec, ctx, block_size, size), dense_bytes(spec, ctx, size)
    print(
        f"a {pool / 2**30:g} GiB pool admits {pool // ours} concurrent {ctx}-token requests "
        f"compressed, {pool // dense} uncompressed ({ours / 2**20:.1f} vs "
        f"{dense / 2**20:.1f} MiB a request)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=64, help="tokens a block (CPU default)")
    ap.add_argument("--dtype-bytes", type=float, default=2.0, help="bytes a KV value (bf16: 2)")
    ap.add_argument("--time", action="store_true", help="also time decode steps (minutes)")
    ap.add_argument("--context", type=int, default=8 << 10, help="--time: tokens of context")
    ap.add_argument("--batches", default="1,16", help="--time: batch sizes")
    args = ap.parse_args()
    bs, size = args.block_size, args.dtype_bytes
    layout_report("tiny (tests/test_deepseek_v4.py)", TINY, bs, size, 64 << 20)
    layout_report("DeepseekV4Config() defaults", defaults(), bs, size, 64 << 30)
    if args.time:
        from bench.deepseek_v4_step import time_steps

        time_steps(args.context, tuple(int(b) for b in args.batches.split(",")))


if __name__ == "__main__":
    main()
