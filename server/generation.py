"""Turning engine outputs into OpenAI responses: fan-out of `n` choices, merging their streams,
logprobs formatting and usage accounting. No HTTP here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from models.tokenizer import Tokenizer


class RequestFailed(RuntimeError):
    """One request failed inside the engine; the others carry on."""


class RequestTimeout(RuntimeError):
    """The request ran past `request_timeout_s`; it has been aborted."""


@dataclass(slots=True)
class Choice:
    """One (prompt, sample) pair of a request."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: BaseException | None = None
    queue: asyncio.Queue | None = None  # set when admitted to the engine


async def merged_outputs(
    engine: AsyncEngine, choices: list[Choice], timeout_s: float = 0.0
) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run every choice concurrently; yield (choice, delta) in arrival order. Cancelling the
    consumer (or passing `timeout_s`) cancels every choice, which aborts them in the engine."""
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    q: asyncio.Queue[tuple[Choice, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            assert choice.queue is not None, "admit() the choices first"
            async for out in engine.stream(choice.request_id, choice.queue):
                await q.put((choice, out))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((choice, e))
        await q.put((choice, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    remaining = len(choices)
    try:
        while remaining:
            if deadline is None:
                choice, item = await q.get()
            else:
                try:
                    choice, item = await asyncio.wait_for(q.get(), deadline - time.monotonic())
                except TimeoutError:
                    raise RequestTimeout(f"request exceeded the {timeout_s:g} s limit") from None
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            elif item.finish_reason == "error":
                raise RequestFailed(f"request {choice.request_id} failed: {item.error}")
            else:
                choice.token_ids.extend(item.new_token_ids)
                choice.text += item.new_text
                choice.logprobs.extend(item.logprobs)
                choice.num_cached_tokens = item.num_cached_tokens
                if item.finished:
                    choice.finish_reason = item.finish_reason
                    choice.stop_reason = item.stop_reason
                yield choice, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def admit(engine: AsyncEngine, choices: list[Choice], limit: int) -> bool:
    """Open every choice in the engine at once, or none if that would exceed `limit` requests
    in flight. Synchronous: no other request can slip in between the check and the opening."""
    if engine.num_in_flight + len(choices) > limit:
        return False
    for c in choices:
        c.queue = engine.open(c.request_id, c.prompt_ids, c.params)
    return True


def finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop / length; an abort that reaches a client was a stop for it."""
    if reason in (None, "stop", "length"):
        return reason
    return "stop"


def token_str(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs]) -> dict:
    content = []
    for e in entries:
        s = token_str(tokenizer, e.token_id)
        content.append(
            {
                "token": s,
                "logprob": max(e.logprob, -9999.0),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {
                        "token": (t := token_str(tokenizer, i)),
                        "logprob": max(lp, -9999.0),
                        "bytes": list(t.encode()),
                    }
                    for i, lp in e.top
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[TokenLogprobs | None], token_ids: list[int], offset: int
) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for token_id, e in zip(token_ids, entries, strict=True):
        s = token_str(tokenizer, token_id)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
        if e is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(max(e.logprob, -9999.0))
            tops.append({token_str(tokenizer, i): max(lp, -9999.0) for i, lp in e.top})
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
