"""The one client for OpenAI-style server-sent event streams, shared by the benchmarks and tests.

`data(response)` / `adata(response)` yield each `data: ` payload of a streaming httpx response as
it arrives ("[DONE]" included), `events(response)` each with its `event: ` name;
`stream(client, path, body)` posts a streaming request and records what a benchmark measures:
status, TTFT, inter-token latencies, text, usage and any error.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx

DONE = "[DONE]"


def data(response: httpx.Response) -> Iterator[str]:
    """The payload of every `data: ` line of a (sync) streaming response."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[6:]


def events(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    """(the `event: ` name before it, or None; the payload) of every `data: ` line."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            yield name, line[6:]
            name = None


async def adata(response: httpx.Response) -> AsyncIterator[str]:
    """The payload of every `data: ` line of an async streaming response."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[6:]


def content(chunk: dict) -> str:
    """The text a chunk adds: chat `delta.content` or completions `text` of its first choice, or
    a Responses `response.output_text.delta` event's delta."""
    if chunk.get("type") == "response.output_text.delta":
        return chunk["delta"]
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    return (choice["delta"].get("content") if "delta" in choice else choice.get("text")) or ""


@dataclass(slots=True)
class Stream:
    """One streamed request. Times are seconds from sending it: `ttft` to the first non-empty
    content (None if none came), `itl` between content chunks, `e2e` to the end of a completed
    stream (0 unless `ok`). `error`: the first 200 characters of a non-200 body, an error
    event's message, or the transport error."""

    ok: bool = False
    status: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    usage: dict | None = None
    error: str = ""
    response_id: str = ""  # a Responses stream's response id

    def check(self) -> Stream:
        """Raise unless the stream completed."""
        if not self.ok:
            raise RuntimeError(f"stream failed: {self.status}: {self.error}")
        return self


async def stream(
    client: httpx.AsyncClient, path: str, body: dict, headers: dict[str, str] | None = None
) -> Stream:
    """POST `body` to `path` as a stream (usage included) and read it to the end; /v1/responses
    streams (Responses events) are read the same way."""
    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    res = Stream()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode()[:200]
                return res
            async for payload in adata(r):
                if payload == DONE:
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.usage = chunk["usage"]
                elif chunk.get("type") in ("response.completed", "response.incomplete"):
                    res.usage = chunk["response"]["usage"]
                    res.response_id = chunk["response"]["id"]
                delta = content(chunk)
                if delta:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += delta
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res
