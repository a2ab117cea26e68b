"""POST /v1/completions, streaming or not, with echo and prompt logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.llm_engine import LLMEngine
from engine.scoring import score_prompt
from server.errors import APIError, error_body
from server.generation import (
    Choice,
    completion_logprobs,
    finish_reason,
    merged_outputs,
    usage,
)
from server.plumbing import (
    VERSION,
    ServerState,
    check_model,
    parse_body,
    reply,
    sse,
)
from server.protocol import (
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
)
from server.request_flow import (
    Timing,
    admit_or_429,
    check_limits,
    effective_salt,
    event_stream,
    make_choices,
    prompt_usage,
    run_or_disconnect,
    run_to_end,
)


def completion_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    tokenizer = state.ready_engine().engine.tokenizer
    prompt = body.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if tokenizer is None:
                raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
            out.append(tokenizer.encode(p))
        else:
            out.append(list(p))  # type: ignore[arg-type]
    return out


async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    body: CompletionRequest = await parse_body(
        request, CompletionRequest, state.config.server.max_body_bytes
    )
    check_model(state, body.model)
    if body.logprobs is not None and body.logprobs > state.config.server.max_top_logprobs:
        raise APIError(
            400,
            f"logprobs must be at most {state.config.server.max_top_logprobs}",
            param="logprobs",
        )
    prompts = completion_prompts(state, body)
    check_limits(state, body, len(prompts))
    body.cache_salt = effective_salt(state, request, body.cache_salt)
    engine = state.ready_engine()
    tokenizer = engine.engine.tokenizer
    req_id = f"cmpl-{uuid.uuid4().hex}"
    choices = make_choices(state, body, prompts, body.logprobs, req_id, body.max_tokens or 16)
    head = {
        "id": req_id,
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": f"kvserve-{VERSION}",
    }
    timing = Timing(state)

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""

    prompt_texts = [decode(p) for p in prompts]
    echo_lps: list[dict | None] = [None] * len(prompts)
    if body.echo and body.logprobs is not None and tokenizer is not None:
        for i, ids in enumerate(prompts):
            echo_lps[i] = await prompt_logprobs(engine, ids, body.logprobs)
    admit_or_429(state, choices)

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(
            completion_stream(
                state, engine, choices, head, body, prompt_texts, include_usage, timing
            ),
        )

    async def collect() -> Response:
        p, c, cached = await run_to_end(
            engine, choices, body.n, timing, req_id, state.config.server.request_timeout_s
        )
        out_choices = []
        for ch in choices:
            p_idx = ch.index // body.n
            prefix = prompt_texts[p_idx] if body.echo else ""
            lps = None
            if body.logprobs is not None and tokenizer is not None:
                lps = completion_logprobs(tokenizer, list(ch.logprobs), ch.token_ids, len(prefix))
                if body.echo and echo_lps[p_idx] is not None:
                    lps = merge_logprobs(echo_lps[p_idx], lps)
            out_choices.append(
                {
                    "index": ch.index,
                    "text": prefix + ch.text,
                    "logprobs": lps,
                    "finish_reason": finish_reason(ch.finish_reason),
                }
            )
        return reply(
            CompletionResponse,
            {
                **head,
                "object": "text_completion",
                "choices": out_choices,
                "usage": usage(p, c, cached),
            },
        )

    return await run_or_disconnect(request, collect())


async def prompt_logprobs(engine: AsyncEngine, ids: list[int], top: int) -> dict:
    def run(e: LLMEngine) -> tuple[list[float], list[list[tuple[int, float]]]]:
        lp = score_prompt(e, ids).log_softmax(-1)
        idx = __import__("torch").tensor(ids[1:])
        chosen = lp[:-1].gather(1, idx[:, None])[:, 0].tolist() if len(ids) > 1 else []
        tops = []
        if top > 0 and len(ids) > 1:
            vals, ind = lp[:-1].topk(top, dim=-1)
            tops = [
                list(zip(i, v, strict=True))
                for i, v in zip(ind.tolist(), vals.tolist(), strict=True)
            ]
        return chosen, tops

    chosen, tops = await engine.call(run)
    from engine.sampler import TokenLogprobs

    entries: list[TokenLogprobs | None] = [None] + [
        TokenLogprobs(t, lp, tops[k] if tops else [])
        for k, (t, lp) in enumerate(zip(ids[1:], chosen, strict=True))
    ]
    tokenizer = engine.engine.tokenizer
    assert tokenizer is not None
    return completion_logprobs(tokenizer, entries, ids, 0)


def merge_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


async def completion_stream(
    state: ServerState,
    engine: AsyncEngine,
    choices: list[Choice],
    head: dict,
    body: CompletionRequest,
    prompt_texts: list[str],
    include_usage: bool,
    timing: Timing,
) -> AsyncIterator[bytes]:
    tokenizer = engine.engine.tokenizer
    extra = {"usage": None} if include_usage else {}
    offsets = {ch.index: 0 for ch in choices}

    def chunk(index: int, text: str, lps: dict | None, reason: str | None) -> bytes:
        return sse(
            {
                **head,
                "object": "text_completion",
                **extra,
                "choices": [
                    {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}
                ],
            },
            CompletionResponse,
        )

    if body.echo:
        for ch in choices:
            text = prompt_texts[ch.index // body.n]
            offsets[ch.index] = len(text)
            yield chunk(ch.index, text, None, None)
    try:
        async for ch, out in merged_outputs(engine, choices, state.config.server.request_timeout_s):
            if out.new_token_ids:
                timing.token()
            lps = None
            if body.logprobs is not None and tokenizer is not None and out.logprobs:
                lps = completion_logprobs(
                    tokenizer, list(out.logprobs), out.new_token_ids, offsets[ch.index]
                )
            offsets[ch.index] += len(out.new_text)
            if out.new_text or lps:
                yield chunk(ch.index, out.new_text, lps, None)
            if out.finished:
                yield chunk(ch.index, "", None, finish_reason(out.finish_reason))
    except (EngineDeadError, RuntimeError) as e:
        yield sse(error_body(500, f"generation failed: {e}", code="engine_error"), ErrorResponse)
        yield sse("[DONE]")
        return
    p, c, cached = prompt_usage(choices, body.n)
    timing.done(head["id"], p, cached, c)
    if include_usage:
        yield sse(
            {**head, "object": "text_completion", "choices": [], "usage": usage(p, c, cached)},
            CompletionResponse,
        )
    yield sse("[DONE]")
