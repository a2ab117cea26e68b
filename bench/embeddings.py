"""Embeddings/s: kvserve's engine in-process (`LLM.embed`: prefill-only requests batched under
the token budget, pooled in the engine) vs transformers (`AutoModel`, padded batches, the same
pooling), same model and inputs, at batch 1, 16 and 64, side by side in one run.

    python bench/embeddings.py [--model PATH] [--num-inputs 64] [--pooling last|mean]

Inputs are sentences of 16-128 tokens (seeded). Also prints the lowest cosine between the two
implementations' vectors (a sanity check, not a benchmark)."""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from engine import LLM

WORDS = (
    "the of and to in is was for on that with as by at from his her an which they be this "
    "paris france capital river city people history music science water light energy model "
    "language vector search retrieval document query similar meaning sentence cache memory"
).split()


def inputs(n: int, tokenizer, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(16, 128)
        ids: list[int] = []
        while len(ids) < target:
            ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(target)))
        out.append(ids[:target])
    return out


def run_kvserve(llm: LLM, work: list[list[int]], batch: int, pooling: str):
    vectors = []
    t = time.perf_counter()
    for start in range(0, len(work), batch):
        vectors.extend(llm.embed(work[start : start + batch], pooling=pooling))
    return time.perf_counter() - t, torch.stack(vectors)


def load_transformers(path: str):
    from transformers import AutoModel

    d, f = os.path.split(path)
    kwargs = {"gguf_file": f} if f.endswith(".gguf") else {}
    model = AutoModel.from_pretrained(d if kwargs else path, dtype=torch.float32, **kwargs)
    return model.eval()


def run_transformers(model, work: list[list[int]], batch: int, pooling: str):
    vectors = []
    t = time.perf_counter()
    for start in range(0, len(work), batch):
        chunk = work[start : start + batch]
        longest = max(map(len, chunk))
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding: the last token is at -1 for every row
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        with torch.no_grad():
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        if pooling == "last":
            v = h[:, -1]
        else:
            m = mask.unsqueeze(-1).float()
            v = (h * m).sum(1) / m.sum(1)
        vectors.append(torch.nn.functional.normalize(v, dim=-1))
    return time.perf_counter() - t, torch.cat(vectors)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF directory or .gguf; default SmolLM2-135M")
    ap.add_argument("--num-inputs", type=int, default=64)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--pooling", default="last", choices=["last", "mean"])
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()

    llm = LLM(
        args.model,
        max_num_seqs=64,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory="512MiB",
        enable_prefix_caching=False,  # every input computed in full, as transformers does
    )
    assert llm.tokenizer is not None
    work = inputs(args.num_inputs, llm.tokenizer)
    hf = load_transformers(llm.engine.info.model_path)
    run_kvserve(llm, work[:4], 4, args.pooling)  # warm-up (C++ ops built at first use)
    run_transformers(hf, work[:4], 4, args.pooling)
    tokens = sum(map(len, work))
    print(
        f"model {os.path.basename(llm.engine.info.model_path)}, {len(work)} inputs, "
        f"{tokens} tokens, pooling {args.pooling}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'batch':>5} {'kvserve emb/s':>14} {'transformers emb/s':>19} {'ratio':>6} {'min cos':>8}"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        dt_kv, v_kv = run_kvserve(llm, work, batch, args.pooling)
        dt_hf, v_hf = run_transformers(hf, work, batch, args.pooling)
        cos = (v_kv * v_hf).sum(-1).min().item()
        kv, tf = len(work) / dt_kv, len(work) / dt_hf
        print(f"{batch:>5} {kv:>14.1f} {tf:>19.1f} {kv / tf:>5.2f}x {cos:>8.5f}")


if __name__ == "__main__":
    main()
