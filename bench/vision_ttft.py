"""TTFT of a one-image chat against a live kvserve: the picture cold (new to the server: decoded,
encoded by the vision tower, its prompt computed), the picture cached (the same image again:
its blocks are a prefix hit, nothing encoded), and its encoding cached but not its KV (the
prefix cache cleared: decoded, not encoded again, the prompt computed).

    python bench/vision_ttft.py [--model GEMMA3_VLM_DIR | --gemma3-4b DIR] [--requests 8]
        [--size 640x480] [--server-arg=--max-num-batched-tokens=512 ...]

Without --model, the tests' tiny random Gemma 3 vision model (tests/vision_model.py) is built
in a temporary directory and served with blocks of 16 tokens. --gemma3-4b DIR serves Gemma 3
4B's geometry in random bfloat16 weights (bench/random_vlm.py; built into DIR once, ~7.3 GB,
kept for the next run), its pictures 896x896 in 256 soft tokens. Sequential requests (one at
a time), streamed; prints mean and p50 TTFT per case, the cached tokens, the encoder-cache
counters, and the serving dtype the server chose. Run it with the checkout first on
PYTHONPATH (`harness` launches the server from the checkout it is imported from)."""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from bench.chat_record import chat_record
from harness import sse
from harness.launch import Server

# a 4B model on a few CPU cores, one request at a time: the startup's step-cost and encoder
# timings (a 1,024-token step and an 896x896 picture, several rounds each) would take over ten
# minutes, so every step may take the full token budget; two sequences, so that the windowed
# layers' pool (each sequence's 1,024-token window) stays small beside a 1 GiB cache; no
# speculation, no packed weight copies (2x the 7.3 GB)
GEMMA3_4B_SERVER_ARGS = [
    "--target-step-ms=-1",
    "--max-num-seqs=2",
    "--kv-cache-memory=1GiB",
    "--max-model-len=4096",
    "--num-speculative-tokens=0",
    "--no-cpu-packed-weights",
]


def picture(seed: int, size: tuple[int, int]) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


async def one(client: httpx.AsyncClient, image: bytes, max_tokens: int) -> dict:
    content = [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "Describe this picture."},
    ]
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return chat_record((await sse.stream(client, "/v1/chat/completions", body)).check())


def serving_dtype(log: str) -> str:
    """The ready banner's dtype line (the dtype and why)."""
    found = re.findall(r"^\s*dtype\s+(\S.*)$", log, re.M)
    return found[0] if found else "(not in the log)"


def counter(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    found = re.findall(rf"^kvserve:{name}(?:_total)? (\S+)$", text, re.M)
    return float(found[0]) if found else float("nan")


async def run(base: str, n: int, size: tuple[int, int], max_tokens: int) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await one(client, picture(10_000, size), max_tokens)  # warm-up (first-request costs)
        cases: dict[str, list[dict]] = {"cold": [], "cached": [], "encoded, KV not cached": []}
        for i in range(n):  # interleaved, so that load on the machine spreads over all three
            cases["cold"].append(await one(client, picture(i, size), max_tokens))
            cases["cached"].append(await one(client, picture(i, size), max_tokens))
            await client.post("/reset_prefix_cache")  # the KV goes, the encoding stays
            cases["encoded, KV not cached"].append(await one(client, picture(i, size), max_tokens))
    for name, results in cases.items():
        ttfts = sorted(r["ttft"] for r in results)
        print(
            f"{name:24s} TTFT mean {statistics.mean(ttfts) * 1000:8.1f} ms  "
            f"p50 {ttfts[len(ttfts) // 2] * 1000:8.1f} ms  cached "
            f"{statistics.mean(r['cached'] for r in results):.0f} of "
            f"{statistics.mean(r['prompt'] for r in results):.0f} prompt tokens"
        )
    print(
        f"encoder cache: {counter(base, 'encoder_cache_misses'):.0f} images encoded, "
        f"{counter(base, 'encoder_cache_hits'):.0f} found cached"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a Gemma 3 vision-language HF directory")
    which.add_argument(
        "--gemma3-4b",
        type=Path,
        default=None,
        help="Gemma 3 4B's geometry in random weights, built here once",
    )
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--size", default="640x480", help="the pictures' width x height")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--server-arg", action="append", default=[])
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds for the server to load the model",
    )
    args = ap.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    server_args = list(args.server_arg)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.gemma3_4b is not None:
            from bench.random_vlm import build_gemma3_4b

            model = str(build_gemma3_4b(args.gemma3_4b))
            server_args = [*GEMMA3_4B_SERVER_ARGS, *server_args]
        elif model is None:  # the tests' builder, from the checkout's root
            # its prompts are ~40 tokens: blocks of 16, so that the picture's are full ones
            server_args = ["--block-size", "16", *server_args]
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.vision_model import build_gemma3_vlm

            model = str(build_gemma3_vlm(Path(tmp) / "tiny-gemma3-vlm"))
        server_args = ["--model", model, *server_args]
        with Server(server_args, timeout=args.startup_timeout) as server:
            print(f"served: {serving_dtype(server.log())}")
            asyncio.run(run(server.base, args.requests, size, args.max_tokens))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
