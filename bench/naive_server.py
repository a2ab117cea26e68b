"""The naive baseline peer: an OpenAI-style chat server around `transformers` with a contiguous KV
cache (transformers' DynamicCache), one request at a time -- no paging, no batching, no prefix
cache. What one would write first; `bench/compare.py` measures kvserve against it.

    python bench/naive_server.py --model bench/.peers/models/hf --port 8001

Serves `POST /v1/chat/completions` (streaming or not, greedy or temperature sampling,
`max_tokens`, `ignore_eos`, usage incl. `stream_options.include_usage`), `GET /v1/models` and
`GET /health`. Requests queue on one lock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


class NaiveGenerator:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = self.tokenizer.eos_token_id

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    @torch.inference_mode()
    def tokens(
        self, ids: list[int], max_tokens: int, temperature: float, ignore_eos: bool
    ) -> Iterator[int]:
        """Prefill once, then one forward per token over the growing contiguous cache."""
        out = self.model(torch.tensor([ids]), use_cache=True)
        cache = out.past_key_values
        for _ in range(max_tokens):
            logits = out.logits[0, -1]
            if temperature > 0:
                probs = torch.softmax(logits / temperature, -1)
                token = int(torch.multinomial(probs, 1))
            else:
                token = int(logits.argmax())
            if token == self.eos and not ignore_eos:
                return
            yield token
            out = self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values


def build_app(gen: NaiveGenerator, model_name: str) -> Starlette:
    lock = asyncio.Lock()

    async def stream_tokens(
        body: dict, ids: list[int], max_tokens: int
    ) -> AsyncIterator[tuple[str, int]]:
        """(text delta, tokens so far), produced by a worker thread under the lock."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, int] | None] = asyncio.Queue()

        def work() -> None:
            produced: list[int] = []
            text = ""
            for token in gen.tokens(
                ids,
                max_tokens,
                float(body.get("temperature", 1.0) or 0.0),
                bool(body.get("ignore_eos", False)),
            ):
                produced.append(token)
                full = gen.tokenizer.decode(produced, skip_special_tokens=True)
                if not full.endswith("\ufffd"):  # wait for a whole UTF-8 character
                    loop.call_soon_threadsafe(queue.put_nowait, (full[len(text) :], len(produced)))
                    text = full
            tail = gen.tokenizer.decode(produced, skip_special_tokens=True)[len(text) :]
            loop.call_soon_threadsafe(queue.put_nowait, (tail, len(produced)))
            loop.call_soon_threadsafe(queue.put_nowait, None)

        async with lock:
            threading.Thread(target=work, daemon=True).start()
            while (item := await queue.get()) is not None:
                yield item

    async def chat(request: Request) -> Response:
        body = await request.json()
        ids = gen.prompt_ids(body["messages"])
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 256)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        def chunk(delta: dict, finish: str | None = None, use: dict | None = None) -> str:
            choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if delta else []
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created}
            obj |= {"model": model_name, "choices": choices}
            if use is not None:
                obj["usage"] = use
            return f"data: {json.dumps(obj)}\n\n"

        if body.get("stream"):

            async def events() -> AsyncIterator[str]:
                n = 0
                yield chunk({"role": "assistant", "content": ""})
                async for delta, count in stream_tokens(body, ids, max_tokens):
                    n = count
                    if delta:
                        yield chunk({"content": delta})
                yield chunk({"content": ""}, "length" if n >= max_tokens else "stop")
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield chunk({}, use=usage(n))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        parts = [item async for item in stream_tokens(body, ids, max_tokens)]
        message = {"role": "assistant", "content": "".join(d for d, _ in parts)}
        n = parts[-1][1] if parts else 0
        finish = "length" if n >= max_tokens else "stop"
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": usage(n),
            }
        )

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model"}]})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a transformers checkpoint directory")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    app = build_app(NaiveGenerator(args.model), "naive-transformers")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
