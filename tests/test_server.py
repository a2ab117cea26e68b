"""The HTTP server end to end: a real uvicorn process on a tiny model, driven by the official
`openai` client and raw httpx; every body and chunk validated against OpenAI's schema."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from harness import sse
from tests.openai_schema import validate
from tests.server_utils import kvserve_server, server_fixture

pytestmark = pytest.mark.slow  # kvserve processes

KEY = "test-key"
MAX_LEN = 256


server = server_fixture(
    num_kv_blocks=128,
    max_model_len=MAX_LEN,
    api_key=KEY,
    allowed_origins="http://example.com",
    served_model_name="tiny",
)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def raw(server, method: str, path: str, key: str | None = KEY, **kw) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, server.base + path, headers=headers, timeout=60, **kw)


def metric(server, name: str) -> float:
    text = raw(server, "GET", "/metrics").text
    m = re.search(rf"^kvserve:{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


HELLO = [{"role": "user", "content": "Hello, how are you?"}]


def test_models(server, client) -> None:
    body = raw(server, "GET", "/v1/models").json()
    validate("ListModelsResponse", body)
    assert [m["id"] for m in body["data"]] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    r = raw(server, "GET", "/v1/models/other")
    assert r.status_code == 404
    validate("ErrorResponse", r.json())


def test_chat_non_streaming_n2(server, client) -> None:
    # a prompt of more than a block, seen once before with one token generated (whose KV is
    # never computed), so exactly its blocks are cached: the n=2 request finds its whole
    # blocks, all but its last token where the prompt is whole blocks (that one is recomputed
    # for its logits), and usage counts them once, for the prompt, not per choice
    messages = [{"role": "user", "content": "Hello, how are you? " * 12}]
    prompt = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    prompt_tokens = prompt.usage.prompt_tokens
    block = raw(server, "GET", "/v1/stats").json()["block_size"]
    assert prompt_tokens > block  # else there is no whole block to find
    resp = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, n=2, temperature=1.0, seed=3
    )
    validate("CreateChatCompletionResponse", resp.model_dump(exclude_unset=True))
    assert len(resp.choices) == 2 and {c.index for c in resp.choices} == {0, 1}
    assert 2 <= resp.usage.completion_tokens <= 16
    assert resp.usage.prompt_tokens == prompt_tokens
    cached = min(prompt_tokens // block * block, prompt_tokens - 1)
    assert resp.usage.prompt_tokens_details.cached_tokens == cached
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_raw_body_matches_schema(server) -> None:
    r = raw(
        server,
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": HELLO,
            "max_tokens": 5,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert r.status_code == 200
    body = r.json()
    validate("CreateChatCompletionResponse", body)
    entries = body["choices"][0]["logprobs"]["content"]
    assert len(entries) == body["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in entries)
    assert all(e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6 for e in entries)


def streamed_with_usage(server, path: str, body: dict) -> list[dict]:
    """The events of a streamed POST to `path` (with a usage chunk), parsed, once the stream
    is checked to be server-sent events ending in [DONE]."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream(
        "POST",
        server.base + path,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}"},
        json={**body, **stream},
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = list(sse.data(r))
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def test_chat_stream_with_usage(server) -> None:
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 10}
    bodies = streamed_with_usage(server, "/v1/chat/completions", body)
    for b in bodies:
        validate("CreateChatCompletionStreamResponse", b)
    assert bodies[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(b["usage"] is None for b in bodies[:-1])
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 10
    finals = [b for b in bodies if b["choices"] and b["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"


def test_seed_reproducible_and_stream_equals_non_stream(client) -> None:
    kw = dict(model="tiny", messages=HELLO, max_tokens=20, temperature=1.0, seed=42)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert a == b == streamed


def test_unicode_round_trip_in_stream(server, client) -> None:
    text = "日本語のテキストと絵文字 🎉🚀"
    ids = raw(server, "POST", "/tokenize", json={"prompt": text}).json()["tokens"]
    bias = {str(t): 8.0 for t in set(ids)}
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": text}],
        max_tokens=40,
        temperature=1.0,
        seed=7,
        logit_bias=bias,
    )
    full = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    ]
    assert "".join(pieces) == full
    assert any(ord(ch) > 0x3000 for ch in full), full
    # A random model may emit byte pieces that are not valid UTF-8; those show as U+FFFD in the
    # full text too. What must hold: a stream never shows a replacement the full text lacks.
    assert sum(p.count("\ufffd") for p in pieces) == full.count("\ufffd")


def test_stop_strings(client) -> None:
    kw = dict(model="tiny", prompt="The quick brown", max_tokens=30, temperature=1.0, seed=5)
    text = client.completions.create(**kw).choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(stop=stop, stream=True, **kw)
        if c.choices
    )
    assert streamed == cut.text


def test_completions_prompt_forms_and_echo(server, client) -> None:
    r = raw(
        server,
        "POST",
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": ["Hello", "World"],
            "max_tokens": 4,
            "n": 2,
            "logprobs": 2,
        },
    )
    body = r.json()
    validate("CreateCompletionResponse", body)
    assert len(body["choices"]) == 4
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 4
    ids = raw(server, "POST", "/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    for prompt in (ids, [ids, ids]):
        res = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
        validate("CreateCompletionResponse", res.model_dump(exclude_unset=True))
        assert res.usage.prompt_tokens == len(ids) * (2 if isinstance(prompt[0], list) else 1)
    echo = client.completions.create(model="tiny", prompt="Hello", max_tokens=3, echo=True)
    assert echo.choices[0].text.startswith("Hello")
    scored = raw(
        server,
        "POST",
        "/v1/completions",
        json={"prompt": "Hello world", "max_tokens": 1, "echo": True, "logprobs": 1},
    ).json()
    lps = scored["choices"][0]["logprobs"]
    assert lps["token_logprobs"][0] is None and all(x <= 0 for x in lps["token_logprobs"][1:])


def test_completions_stream(server) -> None:
    bodies = streamed_with_usage(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 6})
    for b in bodies[:-1]:
        # OpenAI's schema types finish_reason and usage as non-null, yet OpenAI's own completion
        # streams send finish_reason null until the last chunk and usage null on all but the
        # usage chunk (as we do); validate everything else.
        fixed = [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in b["choices"]]
        assert b.pop("usage") is None
        validate("CreateCompletionResponse", {**b, "choices": fixed})
    assert all(c["finish_reason"] is None for b in bodies[:-2] for c in b["choices"])
    assert bodies[-1]["usage"]["completion_tokens"] == 6


BAD = [
    ("invalid json", "/v1/chat/completions", b"{not json", 400, None),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "x", "content": "a"}]},
        400,
        "messages.0.role",
    ),
    (
        "temperature type",
        "/v1/chat/completions",
        {"messages": HELLO, "temperature": "hot"},
        400,
        "temperature",
    ),
    (
        "temperature range",
        "/v1/chat/completions",
        {"messages": HELLO, "temperature": -1},
        400,
        "temperature",
    ),
    ("n huge", "/v1/chat/completions", {"messages": HELLO, "n": 1000}, 400, "n"),
    (
        "max_tokens huge",
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": 10**9},
        400,
        "max_tokens",
    ),
    (
        "max_tokens negative",
        "/v1/chat/completions",
        {"messages": HELLO, "max_tokens": -5},
        400,
        "max_tokens",
    ),
    (
        "top_logprobs 100",
        "/v1/chat/completions",
        {"messages": HELLO, "logprobs": True, "top_logprobs": 100},
        400,
        "top_logprobs",
    ),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-9", "messages": HELLO}, 404, "model"),
    (
        "bad logit_bias",
        "/v1/chat/completions",
        {"messages": HELLO, "logit_bias": {"x": 1}},
        400,
        "logit_bias",
    ),
    ("empty prompt", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("token out of vocab", "/v1/completions", {"prompt": [10**7]}, 400, "prompt"),
    ("prompt list of junk", "/v1/completions", {"prompt": [{"a": 1}]}, 400, "prompt"),
    ("body not object", "/v1/completions", [1, 2], 400, None),
    (
        "content wrong type",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages.0.content",
    ),
    (
        "too many stops",
        "/v1/chat/completions",
        {"messages": HELLO, "stop": ["a"] * 20},
        400,
        "stop",
    ),
    ("stop too long", "/v1/chat/completions", {"messages": HELLO, "stop": "x" * 1000}, 400, "stop"),
    ("top_p zero", "/v1/chat/completions", {"messages": HELLO, "top_p": 0}, 400, "top_p"),
    (
        "presence_penalty 5",
        "/v1/chat/completions",
        {"messages": HELLO, "presence_penalty": 5},
        400,
        "presence_penalty",
    ),
    ("seed huge", "/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed"),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": HELLO, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("completion logprobs 50", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("min_p 2", "/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    (
        "repetition_penalty 0",
        "/v1/completions",
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    ("model wrong type", "/v1/completions", {"prompt": "x", "model": 5}, 400, "model"),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt"),
    ("detokenize bad id", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("negative top_k", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, name, path, body, status, param) -> None:
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = raw(server, "POST", path, **kw)
    assert r.status_code == status, r.text
    err = r.json()
    validate("ErrorResponse", err)
    assert set(err["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["error"]["param"] == param, err
    ok = raw(server, "POST", "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


def test_context_overflow_names_both_numbers(server) -> None:
    r = raw(server, "POST", "/v1/completions", json={"prompt": [5] * 200, "max_tokens": 100})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(MAX_LEN) in msg and "300" in msg


def test_auth_routes_and_cors(server) -> None:
    assert raw(server, "GET", "/health", key=None).status_code == 200
    for path in ("/v1/models", "/metrics", "/version"):
        r = raw(server, "GET", path, key=None)
        assert r.status_code == 401, path
        validate("ErrorResponse", r.json())
    assert raw(server, "GET", "/v1/models", key="wrong").status_code == 401
    r = raw(server, "GET", "/nope")
    assert r.status_code == 404 and r.json()["error"]["message"].startswith("route not found")
    r = raw(
        server,
        "POST",
        "/v1/completions",
        content=b"x" * 5_000_000,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413
    pre = raw(
        server,
        "OPTIONS",
        "/v1/chat/completions",
        key=None,
        headers={
            "Origin": "http://example.com",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://example.com"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base + "/v1", api_key="bad", max_retries=0).models.list()


def test_tokenize_detokenize_version(server) -> None:
    ids = raw(server, "POST", "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert (
        raw(server, "POST", "/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"
    )
    chat = raw(server, "POST", "/tokenize", json={"messages": HELLO}).json()
    assert chat["count"] > len(ids)
    assert raw(server, "GET", "/version").json()["version"]


def test_disconnects_free_everything(server) -> None:
    async def cut_one(client: httpx.AsyncClient) -> None:
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": HELLO, "max_tokens": 200, "stream": True, "ignore_eos": True},
        ) as r:
            n = 0
            async for _ in sse.adata(r):
                n += 1
                if n >= 3:
                    return  # leaving the context manager closes the connection

    async def main() -> None:
        async with httpx.AsyncClient(
            base_url=server.base, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
        ) as client:
            await asyncio.gather(*(cut_one(client) for _ in range(20)))

    asyncio.run(main())
    for _ in range(100):
        if (
            metric(server, "num_requests_running") == 0
            and metric(server, "num_requests_waiting") == 0
        ):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(server, "num_requests_running") == 0
    assert metric(server, "kv_cache_usage_perc") == 0.0
    assert "Traceback" not in server.log() and " ERROR " not in server.log()


def test_metrics_names(server) -> None:
    text = raw(server, "GET", "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "generation_tokens_total",
    ):
        assert f"kvserve:{name}" in text, name


def test_queue_full_gets_429(llama_dir) -> None:
    with kvserve_server(
        llama_dir, num_kv_blocks=64, max_num_seqs=1, max_queue_len=1, max_model_len=512
    ) as s:

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.base, timeout=120) as c:
                return await asyncio.gather(
                    *(
                        c.post(
                            "/v1/completions",
                            json={"prompt": "hi", "max_tokens": 300, "ignore_eos": True},
                        )
                        for _ in range(6)
                    )
                )

        codes = [r.status_code for r in asyncio.run(main())]
        assert codes.count(200) >= 2 and 429 in codes, codes
        r429 = next(r for r in asyncio.run(main()) if r.status_code == 429)
        assert r429.headers["retry-after"] == "1"
        validate("ErrorResponse", r429.json())


def cached_tokens(server, key: str, **body) -> int:
    r = raw(server, "POST", "/v1/completions", key=key, json={"max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_and_reset_over_http(server) -> None:
    prompt = list(range(40, 180))  # over two 64-token blocks
    assert raw(server, "POST", "/reset_prefix_cache", key=None).status_code == 401
    assert raw(server, "POST", "/reset_prefix_cache").status_code == 200
    assert cached_tokens(server, KEY, prompt=prompt, cache_salt="a") == 0
    assert cached_tokens(server, KEY, prompt=prompt, cache_salt="b") == 0
    assert cached_tokens(server, KEY, prompt=prompt, cache_salt="a") == 128
    assert cached_tokens(server, KEY, prompt=prompt) == 0
    assert metric(server, "prefix_cache_hits_total") >= 128
    assert raw(server, "POST", "/reset_prefix_cache").status_code == 200
    assert cached_tokens(server, KEY, prompt=prompt, cache_salt="a") == 0


def test_salt_cache_per_key(llama_dir) -> None:
    with kvserve_server(llama_dir, num_kv_blocks=64, api_key="k1,k2", salt_cache_per_key=True) as s:
        prompt = list(range(40, 180))
        assert cached_tokens(s, "k1", prompt=prompt) == 0
        assert cached_tokens(s, "k2", prompt=prompt) == 0
        assert cached_tokens(s, "k1", prompt=prompt) == 128
        assert cached_tokens(s, "k2", prompt=prompt) == 128
        assert raw(s, "GET", "/v1/models", key="k3").status_code == 401
