"""POST /v1/chat/completions, streaming or not."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from models.chat_template import TemplateError
from server.errors import APIError
from server.generation import Choice, chat_logprobs, finish_reason
from server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from server.request_flow import (
    Generation,
    check_limits,
    effective_salt,
    make_choices,
    session_id,
)
from server.state import ServerState
from server.wire import parse_body, reply


def render_chat(
    engine: AsyncEngine, messages: list, add_generation_prompt: bool, **kw
) -> list[int]:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer; use /v1/completions with token ids")
    try:
        text = tokenizer.apply_chat_template(
            [m.template_dict() for m in messages],
            add_generation_prompt=add_generation_prompt,
            **kw,
        )
    except (TemplateError, ValueError) as e:
        raise APIError(400, str(e), param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.kv
    cfg = state.config.server
    body = await parse_body(request, ChatCompletionRequest, cfg.max_body_bytes)
    state.check_model(body.model)
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(
                400, "logprobs must be true when top_logprobs is set", param="top_logprobs"
            )
        if body.top_logprobs > cfg.max_top_logprobs:
            raise APIError(
                400, f"top_logprobs must be at most {cfg.max_top_logprobs}", param="top_logprobs"
            )
    check_limits(state, body)
    engine = state.ready_engine()
    ids = render_chat(
        engine, body.messages, body.add_generation_prompt, **(body.chat_template_kwargs or {})
    )
    body.cache_salt = effective_salt(state, request, body.cache_salt)
    session = session_id(request, body.user)
    state.sessions.begin_turn(session, ids)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    req_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = body.max_completion_tokens or body.max_tokens or cfg.default_max_tokens or None
    choices = make_choices(engine, body, [ids], logprobs, req_id, max_tokens)

    def end_turn(choices: list[Choice]) -> None:
        first = choices[0]
        state.sessions.end_turn(
            session, first.prompt_ids + first.token_ids, first.params.cache_salt
        )

    gen = Generation.admit(state, engine, choices, body.n, req_id, on_done=end_turn)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return gen.stream(ChatChunks(engine, logprobs is not None), include_usage)

    def respond(usage: dict) -> Response:
        return reply(
            ChatCompletionResponse,
            {
                **gen.head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": ch.index,
                        "message": {"role": "assistant", "content": ch.text, "refusal": None},
                        "logprobs": chat_logprobs(engine.tokenizer, ch.logprobs)
                        if logprobs is not None
                        else None,
                        "finish_reason": finish_reason(ch.finish_reason),
                    }
                    for ch in choices
                ],
                "usage": usage,
            },
        )

    return await gen.collect(request, respond)


class ChatChunks:
    model = ChatCompletionChunk
    object = "chat.completion.chunk"

    def __init__(self, engine: AsyncEngine, logprobs: bool) -> None:
        self.tokenizer = engine.tokenizer
        self.logprobs = logprobs

    def opening(self, choice: Choice) -> dict:
        return {
            "index": choice.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def delta(self, choice: Choice, out: RequestOutput) -> dict | None:
        if not (out.new_text or out.logprobs):
            return None
        lp = chat_logprobs(self.tokenizer, out.logprobs) if self.logprobs else None
        return {
            "index": choice.index,
            "delta": {"content": out.new_text},
            "logprobs": lp,
            "finish_reason": None,
        }

    def closing(self, choice: Choice, out: RequestOutput) -> dict:
        return {
            "index": choice.index,
            "delta": {},
            "logprobs": None,
            "finish_reason": finish_reason(out.finish_reason),
        }
