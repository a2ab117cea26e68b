"""POST /v1/completions, streaming or not, with echo and prompt logprobs."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from engine.async_engine import AsyncEngine
from engine.core.outputs import RequestOutput
from server.errors import APIError
from server.flow.constraints import grammar_for, requested
from server.flow.generation import Choice, completion_logprobs, finish_reason
from server.flow.plan import GenerationPlan
from server.flow.request_flow import ChoiceChunks, start
from server.protocol.openai import CompletionRequest, CompletionResponse
from server.protocol.wire import parse_body, reply
from server.state import ServerState

# OpenAI's documented default for the legacy completions API (vLLM keeps it too)
DEFAULT_COMPLETION_TOKENS = 16


def completion_prompts(engine: AsyncEngine, body: CompletionRequest) -> list[list[int]]:
    tokenizer = engine.tokenizer
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
    cfg = state.config.server
    body = await parse_body(request, CompletionRequest, cfg.max_body_bytes)
    state.check_model(body.model)
    if body.logprobs is not None and body.logprobs > cfg.max_top_logprobs:
        raise APIError(400, f"logprobs must be at most {cfg.max_top_logprobs}", param="logprobs")
    if body.suffix is not None:
        raise APIError(400, "suffix is not supported (no fill-in-the-middle)", param="suffix")
    engine = state.ready_engine()
    prompts = completion_prompts(engine, body)
    echo_logprobs = body.echo and body.logprobs is not None and engine.tokenizer is not None
    plan = GenerationPlan(
        req_id=f"cmpl-{uuid.uuid4().hex}",
        body=body,
        prompts=prompts,
        max_tokens=body.max_tokens or DEFAULT_COMPLETION_TOKENS,
        logprobs=body.logprobs,
        grammar=grammar_for(requested(body)),
        kv_transfer_params=body.kv_transfer_params,
        prompt_logprobs=body.logprobs if echo_logprobs else None,
        streamed=bool(body.stream),
    )
    tokenizer = engine.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else ""

    gen = await start(state, engine, request, plan)  # validates the prompts' token ids first
    prompt_texts = [decode(p) for p in prompts] if body.echo else []
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return gen.stream(CompletionChunks(engine, body, prompt_texts, include_usage))

    def respond(usage: dict) -> Response:
        out_choices = []
        for ch in gen.choices:
            p_idx = ch.index // body.n
            prefix = prompt_texts[p_idx] if body.echo else ""
            lps = None
            if body.logprobs is not None and tokenizer is not None:
                lps = completion_logprobs(tokenizer, list(ch.logprobs), ch.token_ids, len(prefix))
                scored = gen.choices[p_idx * body.n]  # the prompt's first choice scored it
                if echo_logprobs and scored.prompt_logprobs is not None:
                    echo = completion_logprobs(
                        tokenizer, scored.prompt_logprobs, scored.prompt_ids, 0
                    )
                    lps = merge_logprobs(echo, lps)
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
            {**gen.head, "object": "text_completion", "choices": out_choices, "usage": usage},
        )

    return await gen.collect(request, respond)


def merge_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


class CompletionChunks(ChoiceChunks):
    """Completion stream chunks have the response's own shape, as OpenAI's do."""

    model = CompletionResponse
    object = "text_completion"

    def __init__(
        self,
        engine: AsyncEngine,
        body: CompletionRequest,
        prompt_texts: list[str],
        include_usage: bool,
    ) -> None:
        super().__init__(include_usage)
        self.tokenizer = engine.tokenizer
        self.body = body
        self.prompt_texts = prompt_texts
        self.offsets: dict[int, int] = {}  # text offset per choice, for logprobs

    def opening(self, choice: Choice) -> dict | None:
        text = self.prompt_texts[choice.index // self.body.n] if self.body.echo else ""
        self.offsets[choice.index] = len(text)
        return self._choice(choice, text, None, None) if self.body.echo else None

    def delta(self, choice: Choice, out: RequestOutput) -> dict | None:
        lps = None
        if self.body.logprobs is not None and self.tokenizer is not None and out.logprobs:
            lps = completion_logprobs(
                self.tokenizer, list(out.logprobs), out.new_token_ids, self.offsets[choice.index]
            )
        self.offsets[choice.index] += len(out.new_text)
        if not (out.new_text or lps):
            return None
        return self._choice(choice, out.new_text, lps, None)

    def closing(self, choice: Choice, out: RequestOutput) -> dict:
        return self._choice(choice, "", None, finish_reason(out.finish_reason))

    @staticmethod
    def _choice(choice: Choice, text: str, lps: dict | None, reason: str | None) -> dict:
        return {"index": choice.index, "text": text, "logprobs": lps, "finish_reason": reason}
