"""What a route makes of its body, in the engine's terms: a `GenerationPlan` (prompts, limits,
grammar, session, transfer parameters), and from it the request's choices with their sampling
parameters made whole. Also who a request belongs to (API key tag, application, cache salt,
session), which the plan's choices carry."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from engine.async_engine import AsyncEngine
from engine.core.images import PromptImage
from engine.core.sampling_params import GrammarSpec, KeepPrefix, LoRARef, ThoughtBudget
from server.errors import APIError
from server.flow.generation import Choice
from server.protocol.openai import SamplingFields
from server.state import ServerState


def api_key_tag(request: Request) -> str:
    """A short hash of the caller's Authorization header: who a request came from, without
    keeping the key."""
    return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()[:16]


def app_name(request: Request, body: Any) -> str:
    """Which application a request belongs to, for the per-application cache statistics
    (server/app_cache.py): X-App, else the API key's tag, else prompt_cache_key, else user."""
    named = request.headers.get("x-app")
    if not named and request.headers.get("authorization"):
        named = "key:" + api_key_tag(request)[:8]
    named = named or getattr(body, "prompt_cache_key", None) or getattr(body, "user", None)
    return (named or "default")[:64]


def effective_salt(state: ServerState, request: Request, salt: str | None) -> str | None:
    """With salt_cache_per_key, the caller's API key enters the cache salt, so tenants holding
    different keys never share KV blocks (and cannot probe each other's prompts by timing)."""
    if not state.config.server.salt_cache_per_key:
        return salt
    return f"key:{api_key_tag(request)}|{salt or ''}"


def session_id(request: Request, user: str | None) -> str | None:
    return request.headers.get("x-session-id") or user


def sampling_fields(data: dict[str, Any], names: dict[str, str]) -> SamplingFields:
    """A route's sampling fields in OpenAI's names (the engine's parameters come from them); a
    value the route's own schema allowed but the engine cannot take is a 400 naming the route's
    field (`names`: OpenAI's name -> the route's)."""
    try:
        return SamplingFields.model_validate(data)
    except ValidationError as e:
        error = e.errors()[0]
        param = names.get(str(error["loc"][0]), str(error["loc"][0])) if error["loc"] else ""
        raise APIError(400, f"{param}: {error['msg']}", param=param or None) from None


def check_limits(state: ServerState, body: Any) -> None:
    cfg = state.config.server
    if body.n > cfg.max_n:
        raise APIError(400, f"n must be at most {cfg.max_n}", param="n")
    stops = body.stop or []
    if len(stops) > cfg.max_stop_sequences:
        raise APIError(400, f"at most {cfg.max_stop_sequences} stop sequences", param="stop")
    if any(len(s) > cfg.max_stop_length for s in stops):
        raise APIError(
            400, f"stop sequences are limited to {cfg.max_stop_length} characters", param="stop"
        )


def logprobs_of(state: ServerState, logprobs: bool, top_logprobs: int | None) -> int | None:
    """How many top alternatives each sampled token's logprob comes with (None: no logprobs),
    as chat and the Responses API both ask it (`top_logprobs`)."""
    cap = state.config.server.max_top_logprobs
    if top_logprobs is not None:
        if not logprobs:
            raise APIError(
                400, "logprobs must be true when top_logprobs is set", param="top_logprobs"
            )
        if top_logprobs > cap:
            raise APIError(400, f"top_logprobs must be at most {cap}", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def make_choices(
    engine: AsyncEngine,
    plan: GenerationPlan,
    cache_salt: str | None,
    app: str | None,
    exports_kv: bool,
    lora: LoRARef | None = None,
) -> list[Choice]:
    """n choices per prompt, each with its sampling parameters made whole (validated against
    the engine once, when submitted). A prompt's first choice scores the prompt (echo), counts
    its cache hit for `app`, and carries its KV out at its end when `exports_kv` (P/D); `lora`:
    the adapter the request's model names."""
    body, grammar = plan.body, plan.grammar[0] if plan.grammar else None
    choices = []
    for p_idx, ids in enumerate(plan.prompts):
        budget = plan.max_tokens
        if budget is None:
            budget = max(1, engine.info.max_model_len - len(ids))
        for i in range(body.n):
            first = i == 0
            params = body.sampling_params(
                budget,
                plan.logprobs,
                seed_offset=i,
                grammar=grammar,
                cache_salt=cache_salt,
                prompt_logprobs=plan.prompt_logprobs if first else None,
                export_kv=exports_kv and first,
                thought_budget=plan.thought_budget,
                keep_prefix=plan.keep_prefix if first else None,
                streamed=plan.streamed,
                lora=lora,
            )
            index = p_idx * body.n + i
            choices.append(
                Choice(
                    index,
                    ids,
                    params,
                    f"{plan.req_id}-{index}",
                    app=app if first else None,
                    images=plan.images if p_idx == 0 else (),
                )
            )
    return choices


@dataclass(frozen=True)
class GenerationPlan:
    """What a route made of its body, in the engine's terms: the one flow (`start`) needs
    nothing else. `body` holds the sampling fields (OpenAI's names, whatever the route);
    `param_names` spells the engine's sampling parameters the way the route's API does, for
    the errors the engine raises in its own terms."""

    req_id: str
    body: Any
    prompts: list[list[int]]
    max_tokens: int | None
    logprobs: int | None
    grammar: tuple[GrammarSpec, str] | None = None
    session: str | None = None  # a session's turns keep their KV warm (server/sessions.py)
    kv_transfer_params: dict | None = None
    prompt_logprobs: int | None = None  # score each prompt too (echo), with this many top
    thought_budget: ThoughtBudget | None = None
    keep_prefix: KeepPrefix | None = None  # cache_control: the prefix pinned after the request
    streamed: bool = False  # the client reads the tokens as they come
    param_names: dict[str, str] = field(default_factory=dict)
    images: tuple[PromptImage, ...] = ()  # the (one) prompt's images (engine/core/images.py)


def renamed(e: APIError | None, names: dict[str, str]) -> APIError:
    assert e is not None
    if e.param in names:
        e.param = names[e.param]
    return e
