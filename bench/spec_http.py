"""Speculation served through HTTP at concurrency 1: kvserve without and with speculative decoding
against llama.cpp's server on the very GGUF kvserve ships (each at its defaults for that file),
over bench/speculative.py's mixed held-out workload (chat, RAG, JSON under a schema, a tool call
as JSON, a code edit, multi-turn), greedy, one request at a time through /v1/chat/completions.
All servers stay up; each round sends the whole workload to each in turn, the order rotated.

    bench/setup_peers.sh llama-server                 # once
    python bench/spec_http.py [--k 8] [--rounds 2] [--max-tokens 128]

Prints output tokens/s per server (completion tokens over the requests' wall time) and kvserve's
ratios: speculation on vs off, and on vs llama-server.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx

from bench import cli, peers
from bench.speculative import workload
from harness.launch import kvserve_cmd
from models.loader import default_model_path


def run(base: str, items: list, max_tokens: int) -> tuple[int, float]:
    """Completion tokens and seconds for the workload, one request at a time."""
    tokens, elapsed = 0, 0.0
    with httpx.Client(base_url=base, timeout=600) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for _, conversation, grammar in items:
            body: dict = {
                "model": model,
                "messages": conversation,
                "temperature": 0,
                "max_tokens": max_tokens,
            }
            if grammar is not None:
                schema = json.loads(grammar.source)
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "out", "schema": schema},
                }
            start = time.perf_counter()
            r = client.post("/v1/chat/completions", json=body)
            elapsed += time.perf_counter() - start
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
    return tokens, elapsed


def main() -> None:
    ap = cli.parser(__doc__, k=8, rounds=2, max_tokens=128, num_chat=4)
    cli.add_flags(ap, peers_dir="bench/.peers", threads=os.cpu_count() or 2)  # llama-server's
    args = ap.parse_args()
    gguf = str(default_model_path())
    catalog = peers.catalog(Path(args.peers_dir), gguf, args.threads, 1, 4096, "default")
    llama = [p for p in catalog.available if p.name == "llama-server"]
    if not llama:
        print("llama-server:", catalog.missing.get("llama-server", "not available"))
    spec_flags = ["--num-speculative-tokens", str(args.k)]
    servers = [
        peers.Peer("kvserve", kvserve_cmd(["--model", gguf, "--num-speculative-tokens", "0"])),
        peers.Peer("kvserve+spec", kvserve_cmd(["--model", gguf, *spec_flags])),
        *llama,
    ]
    items = workload(args.num_chat)
    procs = [peers.start(p) for p in servers]
    totals = {p.name: [0, 0.0] for p in servers}
    try:
        for proc in procs:  # warm-up: first requests compile grammars, fill caches
            run(proc.base, items[:1], 8)
        for i in range(args.rounds):
            order = procs[i % len(procs) :] + procs[: i % len(procs)]
            for proc in order:
                n, dt = run(proc.base, items, args.max_tokens)
                totals[proc.name][0] += n
                totals[proc.name][1] += dt
    finally:
        for proc in procs:
            proc.stop()
    rate = {name: n / dt for name, (n, dt) in totals.items()}
    print(f"c=1, {len(items)} requests x {args.rounds} rounds, greedy, {args.max_tokens} max")
    for name, r in rate.items():
        print(f"{name:<14}{r:>8.1f} tok/s  ({totals[name][0]} tokens)")
    print(f"kvserve+spec vs kvserve: {rate['kvserve+spec'] / rate['kvserve']:.2f}x")
    if "llama-server" in rate:
        print(f"kvserve+spec vs llama-server: {rate['kvserve+spec'] / rate['llama-server']:.2f}x")
        print(f"kvserve vs llama-server: {rate['kvserve'] / rate['llama-server']:.2f}x")


if __name__ == "__main__":
    main()
