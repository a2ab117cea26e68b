"""KV memory of a Gemma 3-shaped model with and without the windowed layers' own pool
(engine/kv/window.py): bytes held while one long prompt runs, and how many long requests one KV
budget runs at once without preempting.

    python bench/window_kv.py [--layers 12] [--window 128] [--prompt 2000] [--budget 64MiB]

The model is a random Gemma 3 text checkpoint written here (Gemma 3's layer pattern: five
windowed layers, then a global one; float32), so the figures are the pool's, not a trained
model's text. Prints, for `reclaim_window_blocks` on and off: the peak KV bytes a single
`--prompt`-token request holds, the full pool's size under `--budget`, and the peak number of
running requests (and preemptions) for `--requests` such prompts under it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench import cli
from engine import LLM, SamplingParams


def write_model(out: Path, args: argparse.Namespace) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.Gemma3TextConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=args.window,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(1024)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    return out


def held_bytes(llm: LLM) -> int:
    """KV bytes in blocks requests hold now, both pools."""
    kv, caches = llm.engine.kv, llm.engine.runner.backend.kv_caches
    full = [c for c in caches if c.shape[2] == kv.pool.num_blocks]
    per_full = sum(c[:, :, 0].numel() * c.element_size() for c in full)
    used = kv.pool.num_blocks - kv.pool.num_free_blocks
    total = used * per_full
    if kv.window is not None:
        windowed = [c for c in caches if c.shape[2] != kv.pool.num_blocks]
        per_window = sum(c[:, :, 0].numel() * c.element_size() for c in windowed)
        total += kv.window.num_live_blocks() * per_window
    return total


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[int, int]:
    """(peak KV bytes held, peak running requests) over the prompts' run."""
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"r{i}", p, params)
    peak_bytes = peak_running = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        peak_bytes = max(peak_bytes, held_bytes(llm))
        peak_running = max(peak_running, llm.engine.scheduler.num_running)
    return peak_bytes, peak_running


def main() -> None:
    ap = cli.parser(__doc__, layers=12, window=128, prompt=2000, requests=8)
    cli.add_flags(ap, budget="64MiB", block_size=16)  # the KV cache's
    args = ap.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [
        [(s * 31 + i * 7) % 1000 + 3 for i in range(args.prompt)] for s in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_model(Path(tmp) / "gemma3", args))
        shape = f"{args.layers} layers (every sixth global), window {args.window}"
        print(f"Gemma 3-shaped: {shape}, blocks of {args.block_size}, float32; {args.budget}")
        for reclaim in (True, False):
            options = dict(
                kv_cache_memory=args.budget,
                block_size=args.block_size,
                max_num_seqs=args.requests,
                num_speculative_tokens=0,
                reclaim_window_blocks=reclaim,
            )
            llm = LLM(path, **options)
            one, _ = run(llm, prompts[:1], params)
            _, running = run(llm, prompts, params)
            kv = llm.engine.kv
            window = f", window pool {kv.window.pool.num_blocks} blocks" if kv.window else ""
            print(
                f"reclaim {'on ' if reclaim else 'off'}: one {args.prompt}-token request holds "
                f"{one / 2**20:6.1f} MiB; full pool {kv.pool.num_blocks} blocks{window}; "
                f"{args.requests} requests: peak {running} running, "
                f"{llm.engine.scheduler.num_preemptions} preemptions"
            )


if __name__ == "__main__":
    main()
