"""Validate bodies against OpenAI's own schema (tests/data/openai-openapi.json, a copy of the
published spec; a newer copy beside the checkout is preferred when present). The spec marks
nullable fields with OpenAPI 3.0's `nullable: true`, which JSON-Schema validators ignore; it is
rewritten to an explicit `null` alternative first."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

SPEC_CANDIDATES = [
    Path(__file__).resolve().parent.parent.parent / "shared" / "openai-openapi.json",
    Path(__file__).resolve().parent / "data" / "openai-openapi.json",
]


def _nullable(node: Any) -> Any:
    if isinstance(node, dict):
        node = {k: _nullable(v) for k, v in node.items()}
        if node.pop("nullable", False) is True:
            return {"anyOf": [node, {"type": "null"}]}
        return node
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    return node


@lru_cache(maxsize=1)
def spec() -> dict:
    for path in SPEC_CANDIDATES:
        if path.is_file():
            return _nullable(json.loads(path.read_text()))
    raise FileNotFoundError("openai-openapi.json not found")


@lru_cache(maxsize=16)
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator({**spec(), "$ref": f"#/components/schemas/{name}"})


def validate(name: str, body: Any) -> None:
    errors = sorted(validator(name).iter_errors(body), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        raise AssertionError(f"{name} schema violation at {list(e.path)}: {e.message}\n{body}")
