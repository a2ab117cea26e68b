"""What a Responses API request gets back: the response object (its echo of the request's
settings, output items, status and usage in the Responses shape) and its event stream."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from engine.core.outputs import RequestOutput
from server.flow.answer import AnswerStream
from server.flow.generation import Choice
from server.flow.request_flow import Generation
from server.flow.responses_items import OutputItems
from server.protocol.responses import FunctionTool, ResponseEvent, ResponsesRequest
from server.protocol.wire import dump


def tool_echo(tool: FunctionTool) -> dict[str, Any]:
    """A tool as the response echoes it (OpenAI's shape: `strict` on functions)."""
    out = tool.model_dump(exclude_none=True)
    if tool.type == "function":
        out["strict"] = tool.strict
    if tool.tools is not None:
        out["tools"] = [tool_echo(t) for t in tool.tools]
    return out


def reasoning_echo(body: ResponsesRequest) -> dict[str, Any] | None:
    """The request's reasoning settings as OpenAI echoes them (honoured: this model does not
    reason, so no reasoning item follows from them)."""
    r = body.reasoning
    if r is None:
        return None
    return {"effort": r.effort, "summary": r.summary or r.generate_summary}


def response_body(
    resp_id: str,
    created: int,
    body: ResponsesRequest,
    model: str,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    text = {"format": {"type": "text"}}
    if body.text is not None and body.text.format is not None:
        text = {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
    choice = body.tool_choice
    tool_choice = (
        choice.model_dump() if choice is not None and not isinstance(choice, str) else choice
    )
    return {
        "id": resp_id,
        "object": "response",
        "created_at": created,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "max_tool_calls": body.max_tool_calls,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": reasoning_echo(body),
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "service_tier": "default",
        "store": body.store is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": text,
        "tool_choice": tool_choice or "auto",
        "tools": [tool_echo(t) for t in body.tools or []],
        "top_logprobs": body.top_logprobs or 0,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "metadata": body.metadata or {},
        "background": False,
        # OpenAI's schema has these as non-null when present
        **({"usage": usage} if usage is not None else {}),
        **({"user": body.user} if body.user is not None else {}),
    }


def responses_usage(
    usage: dict, block_size: int, prefix_caching: bool, reasoning_tokens: int = 0
) -> dict:
    prompt = usage["prompt_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    written = max(0, prompt // block_size * block_size - cached) if prefix_caching else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


class ResponseEvents:
    """The Responses API's event stream: created and in_progress, the output items' events as
    the answer's events come, then completed/incomplete (the stored response) or failed."""

    def __init__(
        self,
        out: OutputItems,
        answer: AnswerStream,
        body: ResponsesRequest,
        resp_id: str,
        created: int,
        finish: Callable[[list[dict[str, Any]], str], dict[str, Any]],
    ) -> None:
        self.out, self.answer = out, answer
        self.body, self.resp_id, self.created = body, resp_id, created
        self.finish = finish  # (output items, status) -> the final response
        self.model = ""
        self.seq = itertools.count()

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = dump(ResponseEvent, {"type": kind, "sequence_number": next(self.seq), **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _snapshot(self, status: str, error: dict | None = None) -> dict[str, Any]:
        return response_body(
            self.resp_id,
            self.created,
            self.body,
            self.model,
            status=status,
            output=self.out.items,
            error=error,
        )

    def begin(self, gen: Generation) -> list[bytes]:
        self.model = gen.head["model"]
        return [
            self._event(kind, {"response": self._snapshot("in_progress")})
            for kind in ("response.created", "response.in_progress")
        ]

    def step(self, choice: Choice, out: RequestOutput) -> list[bytes]:
        answer = self.answer.feed(out.new_text, out.finished, out.finish_reason)
        return [self._event(kind, fields) for kind, fields in self.out.render(answer, out.logprobs)]

    def end(self, gen: Generation, usage: dict) -> list[bytes]:
        final = self.finish(self.out.items, self.out.status)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [self._event(kind, {"response": final})]

    def fail(self, gen: Generation, error: dict) -> list[bytes]:
        return [self._event("response.failed", {"response": self._snapshot("failed", error)})]
