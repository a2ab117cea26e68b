"""The HTTP server on a GPU, as `scripts/gpu_check.sh` runs it: kvserve started on a loopback
port over MODEL (speculation on, as the server ships), then one chat, one grammar-constrained
chat (a JSON schema) and one speculative request (a repetitive prompt, greedy), each checked;
the server stopped by its PID. Exits non-zero on the first failure, printing what it got.

    python scripts/gpu_http_check.py MODEL [--device cuda] [--timeout 40]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness.launch import Server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def chat(base: str, body: dict) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "m", **body}, timeout=60)
    if r.status_code != 200:
        raise SystemExit(f"HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=40.0, help="seconds to /health 200")
    args = ap.parse_args()
    server_args = [
        "--model",
        args.model,
        "--device",
        args.device,
        "--served-model-name",
        "m",
        "--num-kv-blocks",
        "256",
        "--num-speculative-tokens",
        "4",
    ]
    with Server(server_args, timeout=args.timeout, log_level="info") as server:
        base = server.base
        health = httpx.get(f"{base}/health", timeout=10).json()
        print("health:", json.dumps(health)[:300])
        plain = chat(
            base,
            {
                "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        assert plain["choices"][0]["finish_reason"] in ("stop", "length"), plain
        assert plain["usage"]["completion_tokens"] >= 1, plain
        print("chat: ok,", plain["usage"])
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        ask = [{"role": "user", "content": "A person as JSON"}]
        shaped = chat(
            base, {"messages": ask, "max_tokens": 64, "temperature": 0, "response_format": fmt}
        )
        text = shaped["choices"][0]["message"]["content"]
        if shaped["choices"][0]["finish_reason"] == "stop":
            value = json.loads(text)  # a grammar-constrained answer that finished parses
            assert set(value) == {"name", "age"} and isinstance(value["age"], int), value
        print("grammar: ok,", repr(text[:80]))
        prompt = " ".join(["one two three four five six seven eight"] * 12)
        spec = chat(
            base,
            {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 48,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert spec["usage"]["completion_tokens"] == 48, spec["usage"]
        stats = httpx.get(f"{base}/v1/stats", timeout=10).json()
        assert stats["speculation"] is not None, "speculation is off in the served engine"
        by_source = stats["speculation"]["by_source"]
        assert sum(s["draft_tokens"] for s in by_source.values()) > 0, by_source
        print("speculation: ok,", json.dumps(stats["speculation"]["by_source"]))
    print("http check passed")


if __name__ == "__main__":
    main()
