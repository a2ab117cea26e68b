"""The Responses API through real clients (the `openai` SDK, LangChain with
`use_responses_api=True`, LiteLLM's `responses`) against the default model: bodies and every
stream event validated against OpenAI's schema; server-held conversations continued by
`previous_response_id` with their KV found again (cached_tokens), kept per API key, bounded,
and surviving a restart with the disk tier; what cannot be honoured is a 400 naming it."""

from __future__ import annotations

import json
import os
import sqlite3
import time

import httpx
import pytest
from openai import NotFoundError, OpenAI

from harness import sse
from tests.openai_schema import validate
from tests.server_utils import kvserve_server

pytestmark = pytest.mark.slow  # kvserve processes

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import

EVENT_SCHEMAS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
    "strict": True,
}
KEYS = ("key-a", "key-b")
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(smollm2_path, tmp_path_factory):
    db = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    with kvserve_server(
        smollm2_path,
        dtype="float32",  # the same outputs on every CPU
        served_model_name=MODEL,
        max_model_len=2048,
        num_kv_blocks=128,
        block_size=16,
        api_key=",".join(KEYS),
        responses_db=db,
    ) as s:
        s.db = db
        yield s


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base + "/v1", api_key=KEYS[0], max_retries=0)


def http(server, key: str = KEYS[0]) -> httpx.Client:
    return httpx.Client(
        base_url=server.base, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def events(server, body: dict) -> list[dict]:
    """The raw stream, each event checked against its schema and its SSE `event:` line."""
    out = []
    with http(server) as c, c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        for kind, payload in sse.events(r):
            ev = json.loads(payload)
            assert ev["type"] == kind
            validate(EVENT_SCHEMAS[ev["type"]], ev)
            out.append(ev)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    check_item_ids(out)
    return out


def check_item_ids(evs: list[dict]) -> None:
    """Every event that names an item names the one at its output index."""
    ids: dict[int, str] = {}
    for e in evs:
        if e["type"] == "response.output_item.added":
            ids[e["output_index"]] = e["item"]["id"]
        if "item_id" in e:
            assert e["item_id"] == ids[e["output_index"]], e
        if "item" in e:
            assert e["item"]["id"] == ids[e["output_index"]], e


def test_text_after_a_call_keeps_each_event_on_its_item() -> None:
    from server.flow.answer import AnswerPlan, AnswerStream
    from server.flow.responses_items import OutputItems
    from server.flow.tool_parsers import PARSERS

    plan = AnswerPlan(parser=PARSERS["hermes"])
    out, answer = OutputItems(None, plan, False), AnswerStream(plan)
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nthen some text'
    evs = []
    for i in range(0, len(text), 7):  # streamed in small pieces
        evs += [{"type": k, **f} for k, f in out.render(answer.feed(text[i : i + 7]), [])]
    evs += [{"type": k, **f} for k, f in out.render(answer.feed("", True, "stop"), [])]
    check_item_ids(evs)
    assert [it["type"] for it in out.items] == ["function_call", "message"]
    assert [it["status"] for it in out.items] == ["completed", "completed"]


def test_create_whole_and_streamed_agree(server, client) -> None:
    ask = {"model": MODEL, "input": "What is 2+2? Answer with a number.", "temperature": 0}
    whole = client.responses.create(**ask, max_output_tokens=100)
    validate("Response", whole.model_dump(mode="json", exclude_unset=True))
    assert whole.status == "completed" and whole.output_text
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0

    evs = events(server, {**ask, "max_output_tokens": 100, "stream": True})
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == whole.output_text
    final = evs[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["output"][0]["id"] == evs[2]["item"]["id"]

    # the SDK's own stream reader over the same events
    with client.responses.stream(**ask, max_output_tokens=100) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole.output_text

    cut = client.responses.create(**ask, max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_three_turns_reuse_the_conversation_kv(server, client) -> None:
    turns = ["My name is Ada. Say hello.", "What is my name?", "Spell it backwards."]
    r = client.responses.create(
        model=MODEL,
        input=turns[0],
        instructions="You are a brief assistant.",
        temperature=0,
        max_output_tokens=24,
    )
    responses = [r]
    for text in turns[1:]:
        r = client.responses.create(
            model=MODEL,
            input=text,
            previous_response_id=r.id,
            instructions="You are a brief assistant.",
            temperature=0,
            max_output_tokens=24,
        )
        responses.append(r)
    cached = [x.usage.input_tokens_details.cached_tokens for x in responses]
    inputs = [x.usage.input_tokens for x in responses]
    assert cached[0] < cached[1] < cached[2], cached
    # each turn found the previous turn's prompt (and output) again, up to a block boundary
    assert cached[1] >= inputs[0] - 16 and cached[2] >= inputs[1] - 16, (cached, inputs)

    # the same conversation resent whole through chat completions: the same greedy answer
    messages = [{"role": "system", "content": "You are a brief assistant."}]
    for text, resp in zip(turns[:2], responses[:2], strict=True):
        messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": resp.output_text},
        ]
    messages.append({"role": "user", "content": turns[2]})
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=24
    )
    assert chat.choices[0].message.content == responses[2].output_text
    assert chat.usage.prompt_tokens == inputs[2]

    items = client.responses.input_items.list(responses[2].id, order="asc")
    validate("ResponseItemList", items.model_dump(mode="json", exclude_unset=True))
    roles = [(i.type, i.role) for i in items.data]
    assert roles == [("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
    assert items.data[1].id == responses[0].output[0].id
    page = client.responses.input_items.list(responses[2].id, limit=2)  # newest first
    assert [i.id for i in page.data] == [items.data[4].id, items.data[3].id] and page.has_more


def test_retrieve_delete_and_owners(server, client) -> None:
    r = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=8, metadata={"ticket": "42"}
    )
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"ticket": "42"}
    other = OpenAI(base_url=server.base + "/v1", api_key=KEYS[1], max_retries=0)
    with pytest.raises(NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(NotFoundError):
        other.responses.create(model=MODEL, input="Hi", previous_response_id=r.id)
    with pytest.raises(NotFoundError):
        other.responses.delete(r.id)
    with http(server) as c:
        gone = c.delete(f"/v1/responses/{r.id}")
        assert gone.json() == {"id": r.id, "object": "response", "deleted": True}
        assert c.get(f"/v1/responses/{r.id}").status_code == 404
        assert c.get(f"/v1/responses/{r.id}/input_items").status_code == 404
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)


def test_tools_calls_and_outputs_and_json_schema(server, client) -> None:
    r = client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].status == "completed"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21C"}
        ],
        tools=[WEATHER],
        temperature=0,
        max_output_tokens=40,
    )
    assert follow.output_text and follow.usage.input_tokens_details.cached_tokens > 0
    kinds = [i.type for i in client.responses.input_items.list(follow.id, order="asc").data]
    assert kinds == ["message", *["function_call"] * len(calls), "function_call_output"]

    evs = events(
        server,
        {
            "model": MODEL,
            "input": "Weather in Rome?",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "temperature": 0,
            "max_output_tokens": 80,
            "stream": True,
        },
    )
    added = [e for e in evs if e["type"] == "response.output_item.added"]
    assert added[0]["item"]["type"] == "function_call"
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == args and json.loads(args)["city"]

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Give a city and its rank.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=60,
    )
    assert set(json.loads(r.output_text)) == {"city", "rank"}
    assert r.text.format.type == "json_schema"


def test_logprobs_included_on_request(client) -> None:
    r = client.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=5,
        temperature=0,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in lps)


def created(c: httpx.Client, body: dict) -> dict:
    """A response made through HTTP, checked against OpenAI's schema."""
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    validate("Response", r.json())
    return r.json()


def test_reasoning_and_empty_includes_are_honoured_for_a_model_that_does_not_reason(
    server,
) -> None:
    """Codex CLI's every request: reasoning effort and summary, `reasoning.encrypted_content`
    included, not stored. Nothing to reason or summarise: no reasoning item, no reasoning
    tokens, the settings echoed; whole and streamed."""
    body = {
        "model": MODEL,
        "input": "Hi",
        "max_output_tokens": 4,
        "temperature": 0,
        "store": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
    }
    with http(server) as c:
        whole = created(c, body)
        assert [item["type"] for item in whole["output"]] == ["message"]
        assert whole["reasoning"] == {"effort": "medium", "summary": "auto"}
        assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
        with c.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            done = [json.loads(p) for p in sse.data(s)][-1]
        assert done["type"] == f"response.{whole['status']}"  # incomplete: 4 tokens
        assert [item["type"] for item in done["response"]["output"]] == ["message"]
        assert (
            done["response"]["output"][0]["content"][0]["text"]
            == (whole["output"][0]["content"][0]["text"])
        )


def test_namespace_tools_are_flattened_and_calls_mapped_back_hosted_tools_not_offered(
    server,
) -> None:
    """Codex CLI's tools: a `namespace` of functions (offered to the model as
    `namespace.name`, its calls answered with `namespace` and `name` apart, and replayed the
    same way), and a hosted `web_search` this server cannot run (accepted, echoed, never
    offered: a `required` call lands on the namespace's function, the only one there is)."""
    namespace = {
        "type": "namespace",
        "name": "weather_v1",
        "description": "Weather tools",
        "tools": [WEATHER],
    }
    web = {"type": "web_search", "external_web_access": False}
    body = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": [web, namespace],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 80,
    }
    with http(server) as c:
        first = created(c, body)
        (call,) = [o for o in first["output"] if o["type"] == "function_call"]
        assert (call["namespace"], call["name"]) == ("weather_v1", "get_weather")
        assert set(json.loads(call["arguments"])) == {"city"}
        assert first["tools"][0] == web and first["tools"][1]["tools"][0]["name"] == "get_weather"
        # the client replays the call itself (store: false, as Codex does) ...
        replay = {
            **body,
            "tool_choice": "auto",
            "store": False,
            "max_output_tokens": 8,
            "input": [
                {"role": "user", "content": "What is the weather in Paris?"},
                {k: call[k] for k in ("type", "call_id", "namespace", "name", "arguments")},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
            ],
        }
        r = c.post("/v1/responses", json=replay)
        assert r.status_code == 200, r.text
        # ... and a stored continuation renders it the same way: the same prompt tokens
        follow = c.post(
            "/v1/responses",
            json={
                **replay,
                "input": replay["input"][2:],
                "previous_response_id": first["id"],
            },
        )
        assert follow.status_code == 200, follow.text
        assert follow.json()["usage"]["input_tokens"] == r.json()["usage"]["input_tokens"]
        bad = {**body, "tools": [{"type": "namespace", "name": "ns", "tools": [web]}]}
        r = c.post("/v1/responses", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.tools.0.type"


def test_what_cannot_be_honoured_is_a_400_and_stores_nothing(server) -> None:
    def rows() -> int:
        with sqlite3.connect(server.db) as db:
            return db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    before = rows()
    bad = [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"generate_summary": "everything"}}, "reasoning.generate_summary"),
        ({"include": ["message.output_text.logprobs", "no.such.field"]}, "include.1"),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools.0.type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "image_generation_call", "id": "ig_1"}]}, "input.0.type"),
        ({"input": None}, "input"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"max_output_tokens": 5000}, None),  # past the context: 400 from the engine's check
    ]
    with http(server) as c:
        for extra, param in bad:
            r = c.post("/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            if param is not None:
                assert err["param"] == param, (extra, err)
        r = c.post("/v1/responses", json={"input": "Hi", "previous_response_id": "resp_nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
        r = c.get("/v1/responses/resp_nope/input_items", params={"limit": 500})
        assert r.status_code == 404
    assert rows() == before


def test_langchain_and_litellm_speak_it(server) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.base + "/v1",
        api_key=KEYS[0],
        model=MODEL,
        temperature=0,
        max_tokens=30,
        max_retries=0,
        use_responses_api=True,
    )
    msg = llm.invoke("Say hello.")
    assert msg.text and msg.response_metadata.get("id", "").startswith("resp_")
    streamed = "".join(chunk.text for chunk in llm.stream("Say hello."))
    assert streamed == msg.text

    import litellm

    r = litellm.responses(
        model="openai/" + MODEL,
        input="Say hello.",
        api_base=server.base + "/v1",
        api_key=KEYS[0],
        temperature=0,
        max_output_tokens=30,
    )
    assert r.output[0].content[0].text == msg.text


def test_truncation_auto_drops_the_oldest_items(llama_dir) -> None:
    long = " ".join(["word"] * 70)  # 140 tokens: one turn fits in 256, two do not
    with kvserve_server(llama_dir, num_kv_blocks=64, block_size=16, max_model_len=256) as s:
        with httpx.Client(base_url=s.base, timeout=60) as c:
            body = {"input": long, "max_output_tokens": 8, "temperature": 0}
            first = c.post("/v1/responses", json=body).json()
            body = {**body, "previous_response_id": first["id"]}
            assert c.post("/v1/responses", json=body).status_code == 400  # does not fit
            r = c.post("/v1/responses", json={**body, "truncation": "auto"})
            assert r.status_code == 200, r.text
            assert r.json()["truncation"] == "auto"
            assert r.json()["usage"]["input_tokens"] < first["usage"]["input_tokens"] * 2


def test_a_conversation_continues_after_a_restart_from_the_disk_tier(llama_dir, tmp_path) -> None:
    options = {
        "num_kv_blocks": 64,
        "block_size": 16,
        "host_bytes": "16MiB",
        "disk_path": tmp_path / "kv",
    }
    story = "Once upon a time " + " ".join(f"there was a fox number {i}." for i in range(20))
    with kvserve_server(llama_dir, **options) as s, httpx.Client(base_url=s.base) as c:
        first = c.post(
            "/v1/responses", json={"input": story, "max_output_tokens": 8, "temperature": 0}
        ).json()
    assert (tmp_path / "kv" / "responses.sqlite3").is_file()
    with kvserve_server(llama_dir, **options) as s, httpx.Client(base_url=s.base) as c:
        assert c.get(f"/v1/responses/{first['id']}").json()["output"] == first["output"]
        r = c.post(
            "/v1/responses",
            json={
                "input": "And then?",
                "previous_response_id": first["id"],
                "max_output_tokens": 8,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= first["usage"]["input_tokens"] - 16, (cached, first["usage"])
        metrics = c.get("/metrics").text
    disk_hits = [
        line for line in metrics.splitlines() if "disk" in line and not line.startswith("#")
    ]
    assert any(float(line.split()[-1]) > 0 for line in disk_hits), disk_hits


def test_the_store_is_bounded_by_count_and_age(tmp_path) -> None:
    from server.response_store import ResponseStore

    store = ResponseStore(str(tmp_path / "r.sqlite3"), max_responses=3, max_age_s=3600)
    for i in range(5):
        store.put("", "conv", {"id": f"resp_{i}", "output": []}, [])
    assert len(store) == 3 and store.get("", "resp_0") is None and store.get("", "resp_4")
    assert store.get("other-key", "resp_4") is None  # owners are kept apart
    aged = ResponseStore(str(tmp_path / "a.sqlite3"), max_responses=0, max_age_s=1e-9)
    aged.put("", "conv", {"id": "resp_old", "output": []}, [])
    assert aged.get("", "resp_old") is None  # past its age: gone for readers, then deleted
    aged.put("", "conv", {"id": "resp_new", "output": []}, [])
    assert len(aged) <= 1


def test_an_idle_stored_conversation_is_offloaded(llama_dir) -> None:
    """A conversation kept by the Responses API is a session like any other: once idle its KV
    moves to the host tier, and the next turn finds it there."""
    story = " ".join(f"line {i} of the tale." for i in range(30))
    with (
        kvserve_server(
            llama_dir, num_kv_blocks=64, block_size=16, host_bytes="16MiB", idle_seconds=0.5
        ) as s,
        httpx.Client(base_url=s.base, timeout=60) as c,
    ):
        first = c.post("/v1/responses", json={"input": story, "max_output_tokens": 4}).json()

        def offloaded() -> float:
            metrics = c.get("/metrics").text
            line = next(
                x for x in metrics.splitlines() if x.startswith("kvserve:host_kv_offload_blocks")
            )
            return float(line.split()[-1])

        for _ in range(50):
            if offloaded() > 0:
                break
            time.sleep(0.2)
        assert offloaded() >= first["usage"]["input_tokens"] // 16
        r = c.post(
            "/v1/responses",
            json={"input": "Go on.", "previous_response_id": first["id"], "max_output_tokens": 4},
        ).json()
        assert r["usage"]["input_tokens_details"]["cached_tokens"] >= 16

        def swap_ins() -> float:
            metrics = c.get("/metrics").text
            line = next(
                x
                for x in metrics.splitlines()
                if x.startswith("kvserve:host_kv_swap_in_seconds_count")
            )
            return float(line.split()[-1])

        # the turn's blocks came back from the host tier in timed copies; a scrape reads them
        # without draining them
        assert swap_ins() >= 1 and swap_ins() == swap_ins()
