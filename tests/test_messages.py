"""Anthropic's Messages API through Anthropic's own SDK: the same prompt and sampling as chat
completions (the one flow), stop reasons, forced and streamed tool calls as tool_use blocks,
tool results in the prompt, cache reads in usage, count_tokens, `x-api-key`, and errors in
Anthropic's shape with the right status (fuzzed: never a 5xx, never a leaked block)."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_utils import InProcessServer

pytestmark = pytest.mark.slow  # an in-process server

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
    },
}
HELLO = [{"role": "user", "content": "Hello there"}]
# the 2026 SDK no longer sends sampling fields; older clients do, and they are honoured
GREEDY = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def served(llama_dir):
    server = InProcessServer(llama_dir, max_model_len=2048, api_key="secret")
    yield server
    server.stop()


@pytest.fixture
def client(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.base, api_key="secret", max_retries=0)


def all_blocks_free(served) -> bool:
    """Every KV block back in the pool once the engine has settled (a client's last byte can
    arrive a step before its request's blocks are freed)."""
    pool = served.core.kv.pool
    for _ in range(100):
        if pool.num_free_blocks == pool.num_blocks:
            return True
        time.sleep(0.02)
    return False


def test_a_message_is_what_chat_completions_says_for_the_same_prompt(served, client) -> None:
    system = "Answer briefly."
    msg = client.messages.create(model="", max_tokens=12, system=system, messages=HELLO, **GREEDY)
    chat = openai.OpenAI(base_url=served.base + "/v1", api_key="secret", max_retries=0)
    want = chat.chat.completions.create(
        model="",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": system}, *HELLO],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == want.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 12
    prompt = want.usage.prompt_tokens
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == prompt


def test_a_stop_sequence_ends_the_turn_and_is_named(client) -> None:
    whole = client.messages.create(model="", max_tokens=16, messages=HELLO, **GREEDY)
    text = whole.content[0].text
    # two characters from the middle whose first occurrence is not at the start
    stop = next(
        text[i : i + 2]
        for i in range(len(text) // 2, len(text) - 1)
        if text[i : i + 2].strip() and text.index(text[i : i + 2]) > 0
    )
    cut = client.messages.create(
        model="", max_tokens=16, messages=HELLO, stop_sequences=[stop], **GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    "choice",
    [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}],
)
def test_a_forced_call_is_a_tool_use_block_whole_and_streamed(served, client, choice) -> None:
    kw = dict(
        model="", max_tokens=120, messages=HELLO, tools=[WEATHER], tool_choice=choice, **GREEDY
    )
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use", msg
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["unit"] in ("celsius", "fahrenheit")
    assert call.id.startswith("toolu_")
    kinds = []
    with client.messages.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds and "content_block_stop" in kinds
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (call.name, call.input)
    assert final.stop_reason == "tool_use"
    assert final.usage.cache_read_input_tokens > 0  # the same prompt, found in the cache
    assert all_blocks_free(served)


def test_tool_results_and_the_call_before_them_reach_the_prompt(client) -> None:
    turn = [
        *HELLO,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"unit": "celsius"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees, sunny"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    with_result = client.messages.count_tokens(model="", messages=turn, tools=[WEATHER])
    turn[2]["content"][0]["content"] = [{"type": "text", "text": "21 degrees, sunny, no wind"}]
    longer = client.messages.count_tokens(model="", messages=turn, tools=[WEATHER])
    bare = client.messages.count_tokens(model="", messages=HELLO, tools=[WEATHER])
    assert bare.input_tokens < with_result.input_tokens < longer.input_tokens
    msg = client.messages.create(model="", max_tokens=4, messages=turn, tools=[WEATHER])
    assert msg.usage.output_tokens == 4


def test_system_turns_and_replayed_thinking_are_accepted(client) -> None:
    """Claude Code 2.1 sends `system` turns inside messages, `thinking: adaptive` and
    `output_config`; a model that does not reason honours thinking by not thinking."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Hello"},
            ],
        },
        {"role": "user", "content": "Again"},
    ]
    for thinking in ({"type": "enabled", "budget_tokens": 64}, {"type": "adaptive"}):
        msg = client.messages.create(
            model="",
            max_tokens=3,
            messages=messages,
            thinking=thinking,
            output_config={"effort": "high"},
            cache_control={"type": "ephemeral"},
        )
        assert [b.type for b in msg.content] == ["text"] and msg.usage.output_tokens == 3
        assert msg.usage.cache_creation_input_tokens + msg.usage.cache_read_input_tokens > 0


def test_an_output_format_is_followed(client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model="",
        max_tokens=30,
        messages=HELLO,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert msg.stop_reason == "end_turn", msg
    assert isinstance(json.loads(msg.content[0].text)["ok"], bool)


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_errors_come_in_anthropic_shape(served) -> None:
    url, key = served.base + "/v1/messages?beta=true", {"x-api-key": "secret"}
    ok = {"model": "", "max_tokens": 2, "messages": HELLO}
    assert httpx.post(url, json=ok, headers=key).status_code == 200  # x-api-key is the key
    anthropic_error(httpx.post(url, json=ok), 401, "authentication_error")
    no_cap = {"model": "", "messages": HELLO}
    assert "max_tokens" in anthropic_error(
        httpx.post(url, json=no_cap, headers=key), 400, "invalid_request_error"
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "A"}}
    said = anthropic_error(
        httpx.post(
            url, json={**ok, "messages": [{"role": "user", "content": [image]}]}, headers=key
        ),
        400,
        "invalid_request_error",
    )
    assert said.startswith("messages.0.content.0: this model takes text only")
    anthropic_error(
        httpx.post(url, json={**ok, "model": "claude-x"}, headers=key), 404, "not_found_error"
    )
    long = {**ok, "messages": [{"role": "user", "content": "word " * 2500}]}
    said = anthropic_error(httpx.post(url, json=long, headers=key), 400, "invalid_request_error")
    assert "2048" in said  # the context limit, named
    server_tool = {**ok, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    said = anthropic_error(
        httpx.post(url, json=server_tool, headers=key), 400, "invalid_request_error"
    )
    assert said.startswith("tools.0.type")
    said = anthropic_error(
        httpx.post(url, json={**ok, "service_tier": "priority"}, headers=key),
        400,
        "invalid_request_error",
    )
    assert said.startswith("service_tier")
    assert httpx.post(url, json={**ok, "service_tier": "auto"}, headers=key).status_code == 200
    # other routes keep OpenAI's shape
    r = httpx.post(served.base + "/v1/chat/completions", json={"model": ""}, headers=key)
    assert r.status_code == 400 and "error" in r.json() and "type" not in r.json()


BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking", "x"])},
    optional={
        "text": st.one_of(st.text(max_size=8), st.integers()),
        "id": st.text(max_size=4),
        "name": st.text(max_size=4),
        "input": st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        "tool_use_id": st.text(max_size=4),
        "content": st.one_of(st.text(max_size=5), st.none()),
        "thinking": st.text(max_size=4),
    },
)
BODY = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["", "other"]),
        "max_tokens": st.one_of(st.integers(-2, 4), st.text(max_size=2)),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system", "tool"]),
                    "content": st.one_of(st.text(max_size=12), st.lists(BLOCK, max_size=3)),
                }
            ),
            max_size=3,
        ),
        "system": st.one_of(st.text(max_size=8), st.lists(BLOCK, max_size=2)),
        "stop_sequences": st.lists(st.text(max_size=3), max_size=2),
        "temperature": st.one_of(st.floats(-1, 2), st.none()),
        "top_k": st.integers(-1, 5),
        "tools": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["f", "bad name", ""])},
                optional={"input_schema": st.just({"type": "object"}), "type": st.just("x")},
            ),
            max_size=2,
        ),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
            optional={"name": st.sampled_from(["f", "g"])},
        ),
        "stream": st.booleans(),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY)
def test_fuzzed_bodies_get_an_answer_or_an_anthropic_error(served, body) -> None:
    r = httpx.post(
        served.base + "/v1/messages", json=body, headers={"x-api-key": "secret"}, timeout=60
    )
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.json()["type"] == "error"
    assert all_blocks_free(served)


def test_both_sdks_list_the_served_model(served, client) -> None:
    (card,) = client.models.list().data
    chat = openai.OpenAI(base_url=served.base + "/v1", api_key="secret", max_retries=0)
    (same,) = chat.models.list().data
    assert card.id == same.id and card.type == "model" and card.display_name == card.id
    assert same.object == "model" and same.owned_by == "kvserve"
    assert client.models.retrieve(card.id).id == card.id


def test_a_cache_control_breakpoint_keeps_its_prefix_through_eviction(served, client) -> None:
    """Two long system prompts, one marked: a flood of unique prompts larger than the pool
    evicts the unmarked one (LRU), while the marked prefix stays pinned and is read again."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    def system(tag: str) -> str:
        return " ".join(f"{tag}{w}{i}" for i in range(20) for w in words[:5])

    def ask(system_prompt, text: str = "Hi"):
        return client.messages.create(
            model="",
            max_tokens=1,
            system=system_prompt,
            messages=[{"role": "user", "content": text}],
        )

    marked = [{"type": "text", "text": system("m"), "cache_control": {"type": "ephemeral"}}]
    first = ask(marked)
    assert first.usage.cache_creation_input_tokens > 0
    ask(system("u"))
    for i in range(14):  # ~14 x 700 tokens of unique prompts: more than the 128-block pool
        ask(f"flood {i} " + " ".join(f"w{i}x{j}" for j in range(200)))
    again = ask(marked)
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens // 2
    metrics = httpx.get(served.base + "/metrics", headers={"x-api-key": "secret"}).text
    assert "kvserve:kv_pinned_blocks" in metrics and "kvserve:kv_pins_broken_total 0.0" in metrics
    # the unmarked one was evicted: what it reads again is the template's opening at most
    # ("<|im_start|>system\n", shared token by token with the pinned prompt)
    assert ask(system("u")).usage.cache_read_input_tokens <= 16
