"""LoRA adapter overhead against a live kvserve, one server, in one invocation: decode tok/s at
c=16 with every request on the base model vs the same requests spread over 4 adapters (rank
16 on every projection: q/k/v/o/gate/up/down), rounds interleaved (base, mixed, base, mixed) so
that a noisy machine's drift falls on both.

    python bench/lora.py [--model PATH] [--concurrency 16] [--adapters 4] [--rank 16]
        [--rounds 2] [--max-tokens 64] [--server-arg=--dtype=float32 ...]

The adapters are random, written in PEFT's format (adapter_config.json +
adapter_model.safetensors) for the served model's shapes. Prints each round's output tok/s,
the mean ratio mixed/base, and the adapters' line of the server's banner (memory each).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from bench import cli
from harness.launch import Server
from harness.workload import WORDS
from models.loader import default_model_path, load_spec

TARGETS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def write_adapter(out: Path, model: str, rank: int, seed: int) -> Path:
    """A random PEFT adapter of `model`'s shapes (std 0.01: outputs stay text-like)."""
    spec = load_spec(model)
    lay = spec.layers[0]
    h, q, kv, ffn = (
        spec.hidden_size,
        lay.num_heads * lay.head_dim,
        lay.num_kv_heads * lay.head_dim,
        lay.intermediate_size,
    )
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, ffn),
        "up_proj": (h, ffn),
        "down_proj": (ffn, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(spec.num_layers):
        for block, names in TARGETS.items():
            for name in names:
                n_in, n_out = shapes[name]
                key = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [n for names in TARGETS.values() for n in names],
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


async def wave(base: str, models: list[str], prompts: list[str], max_tokens: int) -> float:
    """Every prompt at once (one per client), each to its model; output tok/s."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def one(model: str, prompt: str) -> int:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t = time.perf_counter()
        tokens = await asyncio.gather(*(one(m, p) for m, p in zip(models, prompts, strict=True)))
        return sum(tokens) / (time.perf_counter() - t)


def main() -> None:
    ap = cli.parser(model=None, concurrency=16, adapters=4, rank=16, rounds=2)
    cli.add_flags(ap, max_tokens=64, prompt_words=100)  # a request's
    ap.add_argument("--server-arg", action="append", default=[])
    args = ap.parse_args()
    model = args.model or default_model_path()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"lora{i}" for i in range(args.adapters)]
        modules = [
            f"{n}={write_adapter(Path(tmp) / n, model, args.rank, i)}" for i, n in enumerate(names)
        ]
        server_args = [
            "--model",
            model,
            "--served-model-name",
            "base",
            "--max-loras",
            str(args.adapters),
            "--lora-modules",
            *modules,
            *args.server_arg,
        ]
        with Server(server_args, log_level="info") as server:
            banner = [line for line in server.log().splitlines() if "lora:" in line]
            print("banner:", banner[-1].strip() if banner else "(no lora line)")
            rates: dict[str, list[float]] = {"base": [], "mixed": []}
            c = args.concurrency
            for r in range(args.rounds + 1):  # round 0 warms up both
                for kind in ("base", "mixed"):
                    prompts = [
                        f"{r} {kind} {i}: "
                        + " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                        for i in range(c)
                    ]
                    models = (
                        ["base"] * c
                        if kind == "base"
                        else [names[i % len(names)] for i in range(c)]
                    )
                    rate = asyncio.run(wave(server.base, models, prompts, args.max_tokens))
                    if r:
                        rates[kind].append(rate)
                        print(f"round {r} {kind:5s}: {rate:6.1f} output tok/s at c={c}")
    base, mixed = statistics.mean(rates["base"]), statistics.mean(rates["mixed"])
    print(
        f"mixed over {args.adapters} adapters (rank {args.rank}) / base alone: "
        f"{mixed / base:.2f}x ({mixed:.1f} vs {base:.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
