"""Batch-1 decode of a mixture-of-experts model against a dense model of the same active size,
in one run: does a decode step read only the experts its token chose?

    python bench/moe_decode.py [--experts 8] [--top-k 2] [--hidden 768] [--layers 12]

Both are random Qwen3-style checkpoints written here (float32, no model hub): the MoE has
`experts` experts of width `hidden` per layer, `top-k` a token; the dense model one FFN of width
`top-k * hidden`, so both multiply the same number of weights per token. Prints tok/s of each
(interleaved rounds, medians), the ratio, and each against the memory-bandwidth bound of the
bytes a token reads (active weights + the lm_head; KV is small at this context): that bound
is `bench/roofline.py`'s read rate over those bytes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import cli
from bench.roofline import read_gbps
from engine import LLM, SamplingParams


def write_model(out: Path, moe: bool, args: argparse.Namespace) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    common = dict(
        vocab_size=4096,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if moe:
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=args.experts,
            num_experts_per_tok=args.top_k,
            moe_intermediate_size=args.hidden,
            intermediate_size=args.hidden,
            norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=args.top_k * args.hidden)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(4096)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out


def active_bytes(llm: LLM) -> int:
    """Weight bytes one decode token reads: everything but the unchosen experts and the
    embedding table (a lookup reads one row)."""
    total = 0
    for name, p in llm.engine.model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        size = p.numel() * p.element_size()
        if ".moe.experts." in name:
            layer = llm.engine.model.layers[int(name.split(".")[1])]
            size = size * layer.moe.top_k / len(layer.moe.experts)
        total += size
    return int(total)


def decode_tok_s(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = [[(i * 37) % 4000 + 3 for i in range(64)]]
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompt, params)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = cli.parser(__doc__, experts=8, top_k=2, hidden=768, layers=12, tokens=64, rounds=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engines = {
            kind: LLM(
                str(write_model(Path(tmp) / kind, kind == "moe", args)),
                dtype="float32",
                num_kv_blocks=64,
                num_speculative_tokens=0,
            )
            for kind in ("moe", "dense")
        }
        rates: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(args.rounds):
            for kind, llm in engines.items():
                rates[kind].append(decode_tok_s(llm, args.tokens))
        gbps = read_gbps()
        print(
            f"memory read {gbps:.1f} GB/s (bench/roofline.py); float32; CPU threads "
            f"{torch.get_num_threads()}"
        )
        for kind, llm in engines.items():
            rate, size = statistics.median(rates[kind]), active_bytes(llm)
            bound = gbps * 1e9 / size
            print(
                f"{kind:6s} {rate:7.1f} tok/s  active {size / 2**20:6.1f} MiB/token  "
                f"bound {bound:7.1f} tok/s  {rate / bound:5.1%} of it"
            )
        ratio = statistics.median(rates["moe"]) / statistics.median(rates["dense"])
        print(f"moe / dense (same active size): {ratio:.2f}x")


if __name__ == "__main__":
    main()
