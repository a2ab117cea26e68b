"""Every route goes through one generation flow (server/flow/request_flow.py): what one route
honours, the others honour the same way. Each test here pins a place where the routes' own
copies of the flow had drifted apart."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from harness import sse
from tests.openai_schema import validate
from tests.server_utils import InProcessServer, nan_logits

pytestmark = pytest.mark.slow  # an in-process server

MAX_TOP = 5  # not OpenAI's 20: a route with its own cap would show here


@pytest.fixture(scope="module")
def live(llama_dir):
    s = InProcessServer(llama_dir, max_top_logprobs=MAX_TOP)
    yield s
    s.stop()


def post(live: InProcessServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(live.base + path, json=body, timeout=60)


def test_top_logprobs_is_capped_by_the_servers_limit_on_every_route(live) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    too_many = {"input": "hi", "max_output_tokens": 2, "top_logprobs": MAX_TOP + 1}
    for r in (
        post(live, "/v1/chat/completions", {**chat, "top_logprobs": MAX_TOP + 1}),
        post(live, "/v1/responses", too_many),
    ):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "top_logprobs"
        assert f"at most {MAX_TOP}" in r.json()["error"]["message"]
    ok = post(live, "/v1/responses", {**too_many, "top_logprobs": MAX_TOP})
    assert ok.status_code == 200, ok.text
    text = [p for item in ok.json()["output"] for p in item.get("content", [])]
    assert text and all(len(lp["top_logprobs"]) == MAX_TOP for lp in text[0]["logprobs"])


def stream_events(live: InProcessServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", live.base + path, json={**body, "stream": True}, timeout=60) as r:
        return [json.loads(payload) for payload in sse.data(r) if payload != sse.DONE]


def test_a_mid_stream_failure_has_one_code_on_every_route(live, monkeypatch) -> None:
    nan_logits(monkeypatch, live.core.runner)
    chat = stream_events(
        live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    )
    completion = stream_events(live, "/v1/completions", {"prompt": "hi"})
    response = stream_events(live, "/v1/responses", {"input": "hi"})
    codes = {
        chat[-1]["error"]["code"],
        completion[-1]["error"]["code"],
        response[-1]["response"]["error"]["code"],
    }
    assert codes == {"server_error"}
    validate("ResponseFailedEvent", response[-1])
    validate("ErrorResponse", chat[-1])
    assert live.core.kv.pool.num_free_blocks == live.core.num_blocks


def metric(live: InProcessServer, name: str) -> float:
    text = httpx.get(live.base + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))  # every label set
    )


def test_embeddings_record_request_latency_like_generation(live) -> None:
    before = {
        m: metric(live, m)
        for m in (
            "kvserve:e2e_request_latency_seconds_count",
            "kvserve:request_queue_time_seconds_count",
        )
    }
    r = post(live, "/v1/embeddings", {"input": ["one input", "and another"]})
    assert r.status_code == 200, r.text
    for name, count in before.items():
        assert metric(live, name) == count + 1, name  # one request, two inputs


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}),
        ("/v1/completions", {"prompt": "go"}),
        ("/v1/responses", {"input": "go"}),
    ],
)
def test_a_client_that_leaves_a_whole_response_frees_it_at_the_next_step(
    live, monkeypatch, path, body
) -> None:
    """Not streamed: a client that times out (leaves) aborts its request within a step or two;
    the slot and blocks come back long before its token cap would have been reached."""
    core, original = live.core, live.core.runner.forward

    def slow_forward(out):  # ~50 ms a step: the cap below would take ~20 s
        time.sleep(0.05)
        return original(out)

    monkeypatch.setattr(core.runner, "forward", slow_forward)
    before = core.stats.generation_tokens
    cap = {"max_output_tokens": 400} if path == "/v1/responses" else {"max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            live.base + path,
            json={**body, **cap, "ignore_eos": True, "temperature": 0},
            timeout=0.5,
        )
    deadline = time.monotonic() + 4
    while core.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not core.has_unfinished()
    assert core.stats.generation_tokens - before < 200  # aborted, not run to its cap
    assert core.kv.pool.num_free_blocks == core.num_blocks


def test_a_chat_template_error_on_responses_names_the_input_it_came_from(live, monkeypatch) -> None:
    """/v1/responses renders through every route's renderer; its errors name `input`, not
    `messages`."""
    from models.chat_template import TemplateError
    from server.flow.responses_plan import responses_turns

    tokenizer = live.core.tokenizer
    render = tokenizer.apply_chat_template

    def strict(messages, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if any("bad" in (m["content"] or "") for m in messages):
            raise TemplateError("tool results may not be 'bad'")
        return render(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", strict)
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{"}
    body = {
        "input": [
            {"role": "user", "content": "hi"},
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "bad"},
        ],
        "max_output_tokens": 2,
    }
    r = post(live, "/v1/responses", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input"
    assert "'bad'" in r.json()["error"]["message"]
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "bad"},
    ]
    r = post(live, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # each turn keeps the field the client sent it in: the instructions, two stored items of
    # the previous response, then the client's input (a call joins no turn: it follows a user's)
    text = [{"type": "input_text", "text": "a"}]
    stored = [{"type": "message", "role": role, "content": text} for role in ("user", "assistant")]
    sent = [stored[0], call, {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    turns = responses_turns(stored + sent, "Be brief.", 2)
    sources = ["instructions", *["previous_response_id"] * 2, "input.0", "input.1", "input.2"]
    assert [t.source for t in turns] == sources
