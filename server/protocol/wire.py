"""What crosses the wire: request bodies decoded and validated once, at the edge, for every
route; response bodies and stream chunks passed through their protocol model and serialised
once.

Decoding a body can only end in a parsed object or a 400: the JSON is bounded in nesting depth
and in the length of number literals, non-standard constants (NaN, Infinity) are refused, and a
string holding a lone UTF-16 surrogate (valid JSON escape, invalid Unicode: half of an emoji
pair) is refused naming its field. Refusing rather than replacing: no client we know of sends
them on purpose, and a silently altered prompt is worse than an error that says where it is.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from server.errors import APIError

MAX_DEPTH = 64  # far above any OpenAI body (tool schemas nest ~10 deep)
MAX_NUMBER_DIGITS = 100

BodyT = TypeVar("BodyT", bound=BaseModel)


def _parse_int(text: str) -> int:
    if len(text) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number literal of {len(text)} digits")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number literal of {len(text)} characters")
    return float(text)


def _parse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_tree(data: Any) -> None:
    """Depth and Unicode over the decoded document, iteratively (no recursion to exhaust)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise APIError(
                400, f"request body nests deeper than {MAX_DEPTH} levels", code="invalid_json"
            )
        if isinstance(node, dict):
            for key, value in node.items():
                if _has_lone_surrogate(key):
                    raise _bad_unicode(path)
                stack.append((value, (*path, key)))
        elif isinstance(node, list):
            stack.extend((value, (*path, str(i))) for i, value in enumerate(node))
        elif isinstance(node, str) and _has_lone_surrogate(node):
            raise _bad_unicode(path)


def _bad_unicode(path: tuple[str, ...]) -> APIError:
    param = ".".join(path) or None
    return APIError(
        400,
        f"{param or 'request body'}: string holds an unpaired UTF-16 surrogate escape "
        "(invalid Unicode)",
        param=param,
        code="invalid_unicode",
    )


def decode_json(raw: bytes) -> Any:
    try:
        data = json.loads(
            raw,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except RecursionError:
        raise APIError(
            400, f"request body nests deeper than {MAX_DEPTH} levels", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    _check_tree(data)
    return data


async def parse_body(
    request: Request, model: type[BodyT], limit: int, optional: bool = False
) -> BodyT:
    """The body as `model`; `optional`: an empty body reads as {} (routes with no fields)."""
    raw = await request.body()
    if len(raw) > limit:
        raise APIError(413, f"request body exceeds the limit of {limit} bytes")
    data = decode_json(raw) if raw.strip() or not optional else {}
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_from_loc(err["loc"])
        raise APIError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "none"}


def _param_from_loc(loc: tuple) -> str | None:
    """pydantic locations name union members ("prompt", "list[int]", 0); keep the field path."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p):
            break
        parts.append(str(p))
    return ".".join(parts) or None


def dump(model: type[BaseModel], data: dict) -> bytes:
    """A response body through its protocol model (what we send is what we publish), to JSON
    in one pass."""
    return model.model_validate(data).model_dump_json(exclude_unset=True).encode()


def reply(model: type[BaseModel], data: dict, status: int = 200) -> Response:
    return Response(dump(model, data), status_code=status, media_type="application/json")


def sse(model: type[BaseModel], data: dict) -> bytes:
    return b"data: " + dump(model, data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
