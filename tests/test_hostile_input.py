"""Hostile bodies as raw bytes: what a client can actually send, not the Python values a JSON
encoder would let through. Invalid Unicode escapes, deep nesting, huge numbers, truncated
documents and wrong types on every POST route: never a 5xx, always answered in bounded time, and
the server still healthy and still correct afterwards."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.openai_schema import validate
from tests.server_utils import server_fixture

pytestmark = pytest.mark.slow  # a kvserve process under fuzzing

server = server_fixture(num_kv_blocks=96, max_model_len=256, default_max_tokens=8, max_num_seqs=8)

CANARY = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
LONE = ["\\ud83d", "\\ude00", "\\ude00\\ud83d", "\\udfff", "a\\ud800b"]  # JSON escapes
BODIES = {
    "/v1/chat/completions": {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi there"},
        ],
        "max_tokens": 4,
        "stop": ["\n\n"],
        "temperature": 0,
        "logit_bias": {"5": 1.0},
        "user": "u1",
    },
    "/v1/completions": {"prompt": "hello", "max_tokens": 4, "stop": "x", "n": 1, "seed": 3},
    "/v1/responses": {
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "instructions": "be brief",
        "max_output_tokens": 4,
        "temperature": 0,
        "metadata": {"k": "v"},
    },
    "/tokenize": {"prompt": "hello", "add_special_tokens": True},
    "/detokenize": {"tokens": [5, 6, 7]},
    "/reset_prefix_cache": {},
}
ROUTES = list(BODIES)


def post_raw(base: str, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        base + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30
    )


def with_lone_surrogate(path: str, field: str, stream: bool = False) -> bytes:
    """`field` of the route's body set to a string holding a lone surrogate escape."""
    body = dict(BODIES[path], stream=stream) if stream else dict(BODIES[path])
    marker = "@@LONE@@"
    if field == "messages.user":
        body["messages"] = [{"role": "user", "content": f"x{marker}y"}]
    elif field == "messages.system":
        body["messages"] = [
            {"role": "system", "content": marker},
            {"role": "user", "content": "hi"},
        ]
    else:
        body[field] = f"q{marker}"
    return json.dumps(body).replace(marker, "\\ud83d").encode()


# each route's text fields that a lone surrogate goes into, and whether it goes in streamed too
SURROGATE_FIELDS = {
    "/v1/chat/completions": {
        "messages.user": True,
        "messages.system": True,
        "stop": False,
        "user": False,
    },
    "/v1/completions": {"prompt": True, "stop": False},
    "/tokenize": {"prompt": False},
    "/v1/responses": {"instructions": True, "input": False},
}


@pytest.mark.parametrize(
    "path,field,stream",
    [
        (path, field, stream)
        for path, fields in SURROGATE_FIELDS.items()
        for field, streamed_too in fields.items()
        for stream in ((False, True) if streamed_too else (False,))
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(server, path, field, stream) -> None:
    r = post_raw(server.base, path, with_lone_surrogate(path, field, stream))
    assert r.status_code == 400, r.text
    validate("ErrorResponse", r.json())
    err = r.json()["error"]
    assert err["code"] == "invalid_unicode" and "surrogate" in err["message"]
    assert err["param"].split(".")[0] == field.split(".")[0]


def test_deep_nesting_and_huge_numbers_are_400s(server) -> None:
    for path in ROUTES:
        for raw in (
            b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b'{"prompt": ' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}",
            b'{"max_tokens": 1' + b"0" * 50_000 + b"}",
            b'{"temperature": 1.' + b"5" * 50_000 + b"}",
            b'{"max_tokens": NaN}',
            b'{"temperature": -Infinity}',
        ):
            r = post_raw(server.base, path, raw)
            assert r.status_code == 400, (path, raw[:40], r.text)
            validate("ErrorResponse", r.json())


@pytest.mark.parametrize("stream", [False, True])
def test_out_of_vocabulary_token_ids_with_echo_are_a_400(server, stream) -> None:
    """echo decodes the prompt: only after its token ids are validated (schemathesis found a
    500 for `{"prompt": [[-1]], "echo": true}`)."""
    for prompt in ([[-1]], [10**9], [[3, -5]]):
        body = {"prompt": prompt, "echo": True, "max_tokens": 2, "stream": stream}
        r = httpx.post(server.base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_roles_follow_openai_schema(server) -> None:
    url = server.base + "/v1/chat/completions"

    def chat(messages: list[dict]) -> httpx.Response:
        return httpx.post(url, json={"messages": messages, "max_tokens": 2}, timeout=30)

    for role in ("user", "system", "developer", "tool"):
        missing = chat([{"role": role}])
        assert missing.status_code == 400, missing.text
        assert missing.json()["error"]["param"].startswith("messages.0")
        assert "needs content" in missing.json()["error"]["message"]
        assert chat([{"role": role, "content": None}]).status_code == 400
    no_id = chat([{"role": "user", "content": "a"}, {"role": "tool", "content": "42"}])
    assert no_id.status_code == 400 and "tool_call_id" in no_id.json()["error"]["message"]
    # the assistant's content may be null or absent (a turn that only called tools)
    ok = chat(
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": None},
            {"role": "assistant"},
            {"role": "user", "content": "b"},
        ]
    )
    assert ok.status_code == 200, ok.text


def test_default_max_tokens_bounds_chat_without_max_tokens(server) -> None:
    r = httpx.post(
        server.base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "go"}], "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert "chat max_tokens default: 8" in server.log()


# ---- byte-level fuzz ---------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def hostile_body(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(ROUTES))
    body = json.loads(json.dumps(BODIES[path]))
    if body and draw(st.booleans()):  # wrong type (or value) in one field
        body[draw(st.sampled_from(sorted(body)))] = draw(JSON_VALUES)
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    raw = json.dumps(body)
    kind = draw(st.sampled_from(["surrogate", "nesting", "number", "truncate", "bytes", "none"]))
    if kind == "surrogate" and '"' in raw:
        quotes = [i for i, c in enumerate(raw) if c == '"']
        at = draw(st.sampled_from(quotes))
        raw = raw[: at + 1] + draw(st.sampled_from(LONE)) + raw[at + 1 :]
    elif kind == "nesting":
        depth = draw(st.integers(50, 50_000))
        raw = (
            raw[:-1] + (", " if len(raw) > 2 else "") + '"deep": ' + "[" * depth + "]" * depth + "}"
        )
    elif kind == "number":
        digits = draw(st.integers(200, 60_000))
        raw = raw[:-1] + (", " if len(raw) > 2 else "") + '"max_tokens": ' + "9" * digits + "}"
    elif kind == "truncate":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    data = raw.encode("utf-8", "surrogatepass")
    if kind == "bytes":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.binary(min_size=1, max_size=4)) + data[at:]
    return path, data


@pytest.fixture(scope="module")
def canary_text(server) -> str:
    r = httpx.post(server.base + "/v1/completions", json=CANARY, timeout=30)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(cases=st.lists(hostile_body(), min_size=4, max_size=4))
def test_raw_body_fuzz_never_5xx(server, canary_text, cases) -> None:
    for path, raw in cases:
        start = time.monotonic()
        r = post_raw(server.base, path, raw)
        assert r.status_code < 500, (path, raw[:200], r.status_code, r.text[:300])
        assert time.monotonic() - start < 20
        if r.status_code >= 400:
            validate("ErrorResponse", r.json())
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    canary = httpx.post(server.base + "/v1/completions", json=CANARY, timeout=30)
    assert canary.status_code == 200
    assert canary.json()["choices"][0]["text"] == canary_text


def test_no_blocks_leak_after_hostile_traffic(server) -> None:
    for _ in range(50):
        stats = httpx.get(server.base + "/v1/stats", timeout=10).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.1)
    assert stats["blocks_in_use"] == 0
