"""The size limits OpenAI documents for strict structured-output schemas, checked before a schema
is compiled (each a 400 naming what was exceeded): object properties in all, levels of nesting,
enum values in all, the characters of one large string enum, and the characters of every
property name, definition name, enum value and const value together. They bound the grammar a
schema becomes; the compile budget (engine/grammar/budget.py) bounds its compile time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_PROPERTIES = 5_000
MAX_DEPTH = 10
MAX_ENUM_VALUES = 1_000
LARGE_ENUM = 250  # a string enum with more values than this ...
MAX_LARGE_ENUM_CHARS = 15_000  # ... has at most this many characters in all
MAX_NAME_CHARS = 120_000

# keywords whose value is one subschema a level down / a list or map of subschemas
_NESTED = ("items", "additionalProperties", "contains", "not", "unevaluatedItems")
_LISTS = ("prefixItems",)
_ALTERNATIVES = ("anyOf", "allOf", "oneOf")
_MAPS = ("$defs", "definitions")


@dataclass(slots=True)
class _Size:
    properties: int = 0
    depth: int = 0
    enum_values: int = 0
    chars: int = 0


def schema_limit_error(schema: Any) -> str | None:
    """What `schema` exceeds, in words with the limit, or None."""
    size = _Size()
    _measure(schema, 0, size)
    if size.properties > MAX_PROPERTIES:
        return f"{size.properties} object properties exceed the limit of {MAX_PROPERTIES}"
    if size.depth > MAX_DEPTH:
        return f"{size.depth} levels of nesting exceed the limit of {MAX_DEPTH}"
    if size.enum_values > MAX_ENUM_VALUES:
        return f"{size.enum_values} enum values in all exceed the limit of {MAX_ENUM_VALUES}"
    if size.chars > MAX_NAME_CHARS:
        return (
            f"property names, definition names, enum and const values have {size.chars} "
            f"characters in all, over the limit of {MAX_NAME_CHARS}"
        )
    return _large_enum_error(schema)


def _measure(node: Any, level: int, size: _Size) -> None:
    """Depth counts objects and arrays (their properties and items are a level down);
    alternatives and definitions stay at their level."""
    stack = [(node, level)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, dict):
            continue
        size.depth = max(size.depth, level)
        props = node.get("properties")
        if isinstance(props, dict):
            size.properties += len(props)
            size.chars += sum(len(k) for k in props)
            stack.extend((v, level + 1) for v in props.values())
        enum = node.get("enum")
        if isinstance(enum, list):
            size.enum_values += len(enum)
            size.chars += sum(len(v) for v in enum if isinstance(v, str))
        const = node.get("const")
        if isinstance(const, str):
            size.chars += len(const)
        for key in _NESTED:
            stack.append((node.get(key), level + 1))
        for key in _LISTS:
            if isinstance(node.get(key), list):
                stack.extend((v, level + 1) for v in node[key])
        for key in _ALTERNATIVES:
            if isinstance(node.get(key), list):
                stack.extend((v, level) for v in node[key])
        for key in _MAPS:
            defs = node.get(key)
            if isinstance(defs, dict):
                size.chars += sum(len(k) for k in defs)
                stack.extend((v, level) for v in defs.values())


def _large_enum_error(schema: Any) -> str | None:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and len(enum) > LARGE_ENUM:
                chars = sum(len(v) for v in enum if isinstance(v, str))
                if chars > MAX_LARGE_ENUM_CHARS:
                    return (
                        f"an enum of {len(enum)} values (over {LARGE_ENUM}) has {chars} "
                        f"characters, over the limit of {MAX_LARGE_ENUM_CHARS}"
                    )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return None
