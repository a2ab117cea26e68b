"""Tools and structured outputs through real clients (the `openai` SDK, LangChain, LiteLLM)
against the default model: what they promise comes back, and what cannot be honoured is a 400."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.openai_schema import validate
from tests.tool_schemas import ASK, TIME, WEATHER, ask_for_a_tool

pytestmark = pytest.mark.slow  # kvserve processes and client libraries

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=10**9)


@pytest.fixture(scope="module")
def server(smol_tools_server):
    return smol_tools_server  # shared with test_agents.py (one SmolLM2 start)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def check_weather_args(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    assert isinstance(args["city"], str) and len(args["city"]) <= 20


def test_parse_returns_a_parsed_object(client) -> None:
    done = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and done.choices[0].finish_reason == "stop"


def test_json_object_and_cut_by_max_tokens(client) -> None:
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": 'Reply with the JSON object {"a": 1}.'}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=60,
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    cut = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "A long JSON object about a cat."}],
        response_format={"type": "json_object"},
        max_tokens=3,
    )
    assert cut.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_tool_calls_stream_complete_calls(client, choice) -> None:
    stream = ask_for_a_tool(
        client,
        "SmolLM2-135M-Instruct",
        [WEATHER, TIME],
        choice,
        100,
        temperature=0.7,
        seed=3,
        parallel_tool_calls=False,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        validate(
            "CreateChatCompletionStreamResponse", chunk.model_dump(mode="json", exclude_unset=True)
        )
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for call in calls.values():
        assert call["id"].startswith("call_") and call["name"] in ("get_weather", "get_time")
        if call["name"] == "get_weather":
            check_weather_args(call["arguments"])
    if choice != "required":
        assert [c["name"] for c in calls.values()] == ["get_weather"]


def test_non_streaming_named_call_and_parallel_off(client) -> None:
    r = ask_for_a_tool(
        client, "SmolLM2-135M-Instruct", [WEATHER, TIME], "required", 100, parallel_tool_calls=False
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
    validate("CreateChatCompletionResponse", r.model_dump(mode="json", exclude_unset=True))


def weather_call_history(arguments: str, result: str) -> list[dict]:
    """ASK, an assistant turn calling get_weather with `arguments`, and the tool's `result`."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def rendered(server, history: list[dict]) -> tuple[list[int], str]:
    """The prompt ids and text the server renders for `history` with the weather tool."""
    ids = httpx.post(
        server.base + "/tokenize", json={"messages": history, "tools": [WEATHER]}, timeout=30
    ).json()["tokens"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": ids}, timeout=30).json()
    return ids, text["prompt"]


def test_follow_up_turn_renders_calls_and_results(server, client) -> None:
    history = weather_call_history('{"city": "Paris"}', "21 C, sunny")
    ids, text = rendered(server, history)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in text
    assert '"name": "get_weather"' in text.split("<tools>\n")[1]  # the fallback's tool list
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=history, tools=[WEATHER], max_tokens=8
    )
    assert r.usage.prompt_tokens == len(ids)  # the same rendering reached the model


def test_langchain_structured_output_and_tools(server) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.base + "/v1",
        api_key="unused",
        model="SmolLM2-135M-Instruct",
        temperature=0,
        max_tokens=100,
        max_retries=0,
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(city, City), method

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}


def test_litellm_tools_and_json(server) -> None:
    import litellm

    common = {
        "model": "openai/SmolLM2-135M-Instruct",
        "api_base": server.base + "/v1",
        "api_key": "unused",
        "temperature": 0,
        "max_tokens": 100,
    }
    r = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice="required", **common)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    check_weather_args(call.function.arguments)
    r = litellm.completion(
        messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City,
        **common,
    )
    City.model_validate_json(r.choices[0].message.content)


def test_structured_outputs_extensions_on_both_routes(server) -> None:
    url = server.base
    cases = [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
        ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, lambda t: len(t) == 8),
        ({"guided_regex": "(ab)+"}, lambda t: set(t) <= {"a", "b"}),
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"a": {"type": "boolean"}},
                    "required": ["a"],
                }
            },
            lambda t: isinstance(json.loads(t)["a"], bool),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}},
            lambda t: t in ("xy", "xz"),
        ),
    ]
    for extra, ok in cases:
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 40, **extra},
            timeout=60,
        )
        assert chat.status_code == 200, chat.text
        assert ok(chat.json()["choices"][0]["message"]["content"]), (extra, chat.text)
        cmpl = httpx.post(
            url + "/v1/completions",
            json={"prompt": "Answer:", "max_tokens": 40, **extra},
            timeout=60,
        )
        assert cmpl.status_code == 200, cmpl.text
        assert ok(cmpl.json()["choices"][0]["text"]), (extra, cmpl.text)


def test_what_cannot_be_honoured_is_a_400(server) -> None:
    def chat(**extra) -> httpx.Response:
        body = {"messages": ASK, "max_tokens": 4, **extra}
        return httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)

    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                    },
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
    ]
    for extra, param in cases:
        r = chat(**extra)
        assert r.status_code == 400, (extra, r.text)
        validate("ErrorResponse", r.json())
        assert r.json()["error"]["param"] == param, (extra, r.json())
    image = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ]
    )
    assert image.status_code == 400 and image.json()["error"]["param"] == "messages.0.content.1"
    assert "text only" in image.json()["error"]["message"]
    cmpl = httpx.post(
        server.base + "/v1/completions",
        json={"prompt": "a", "suffix": "b", "max_tokens": 2},
        timeout=30,
    )
    assert cmpl.status_code == 400 and cmpl.json()["error"]["param"] == "suffix"


# the nullable fields chat completions and (legacy) completions share, then each one's own
NULLABLE_SAMPLING = [
    "n",
    "stream",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_p",
    "seed",
    "max_tokens",
    "logit_bias",
    "stop",
    "stream_options",
]
NULLABLE_CHAT = NULLABLE_SAMPLING + [
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "user",
]
NULLABLE_COMPLETION = NULLABLE_SAMPLING + ["echo", "suffix"]


def test_nulls_in_every_nullable_field(server) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    for field in NULLABLE_CHAT:
        body = {**chat, field: None}
        if field == "max_completion_tokens":
            body["max_tokens"] = 4
        r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, (field, r.text)
    everything = {**chat, **dict.fromkeys(NULLABLE_CHAT), "max_tokens": 4}
    r = httpx.post(server.base + "/v1/chat/completions", json=everything, timeout=60)
    assert r.status_code == 200, r.text
    for field in NULLABLE_COMPLETION:
        body = {"prompt": "hi", "max_tokens": 4, field: None}
        if field == "max_tokens":
            body.pop("max_tokens")
            body[field] = None
        r = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, (field, r.text)


def test_developer_role_maps_to_system(server) -> None:
    def render(messages: list[dict]) -> str:
        ids = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()["tokens"]
        return httpx.post(server.base + "/detokenize", json={"tokens": ids}).json()["prompt"]

    dev = render([{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}])
    sys_ = render([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}])
    assert dev == sys_ and "developer" not in dev and "SmolLM" not in dev


def test_legacy_functions_map_onto_tools(client) -> None:
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        functions=[WEATHER["function"]],
        function_call={"name": "get_weather"},
        temperature=0,
        max_tokens=100,
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "function_call"
    assert msg.function_call.name == "get_weather"
    check_weather_args(msg.function_call.arguments)


def test_a_call_cut_by_the_token_cap_is_a_call_never_markup(client) -> None:
    """A forced call the cap cuts short comes back as a call with its arguments as generated
    (finish_reason length), streamed or not; a cut before the call's name leaves no content
    either: the template's markup is never the answer."""
    cut_inside_arguments = 0
    for max_tokens in (6, 14, 20, 24):
        kw = dict(
            model="SmolLM2-135M-Instruct",
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_tokens=max_tokens,
        )
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.content is None, choice.message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(**kw, stream=True)
            if c.choices
        )
        assert "<tool_call" not in streamed and not streamed.strip(), streamed
        for call in choice.message.tool_calls or []:
            assert call.function.name == "get_weather"
            try:
                json.loads(call.function.arguments)
            except json.JSONDecodeError:
                cut_inside_arguments += 1
    assert cut_inside_arguments, "no cap cut a call inside its arguments"
    tool = {"type": "function", **WEATHER["function"]}
    for cap in (6, 20):
        r = client.responses.create(
            model="SmolLM2-135M-Instruct",
            input=ASK[0]["content"],
            tools=[tool],
            tool_choice="required",
            temperature=0,
            max_output_tokens=cap,
        )
        assert r.status == "incomplete"
        texts = [p.text for item in r.output if item.type == "message" for p in item.content]
        assert not "".join(texts).strip(), texts
        assert all(item.name == "get_weather" for item in r.output if item.type == "function_call")


def test_history_with_unfinished_arguments_is_taken_back(server, client) -> None:
    """The next turn sends back the cut-off call the server made: any arguments string is
    accepted (OpenAI's rule) and rendered back as written, on chat and on /v1/responses."""
    partial = '{"city": "Par'
    history = weather_call_history(partial, "error: arguments cut off")
    ids, text = rendered(server, history)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}' in text
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=history, tools=[WEATHER], max_tokens=4
    )
    assert r.usage.prompt_tokens == len(ids)
    items = [
        {"role": "user", "content": ASK[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": partial},
        {"type": "function_call_output", "call_id": "call_1", "output": "cut off"},
    ]
    resp = httpx.post(
        server.base + "/v1/responses",
        json={
            "input": items,
            "tools": [{"type": "function", **WEATHER["function"]}],
            "max_output_tokens": 4,
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


def test_forced_calls_are_compact_and_end_the_turn(client) -> None:
    """A forced call's arguments carry no optional whitespace (a small model spends its budget
    on the call, not on indentation) and the turn ends right after it. With parallel calls
    allowed (OpenAI's default) this 135M model goes on calling until the cap: each call is
    still a call, the one the cap cut keeps its arguments as generated, and no markup or
    separator leaks into `content`."""
    for parallel in (False, None):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        r = ask_for_a_tool(client, "SmolLM2-135M-Instruct", [WEATHER], "required", 60, **extra)
        choice = r.choices[0]
        assert choice.message.content is None, choice.message.content
        calls = choice.message.tool_calls
        if parallel is False:
            assert choice.finish_reason == "tool_calls" and len(calls) == 1
            assert r.usage.completion_tokens < 60
        finished = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert finished, calls
        for call in finished:
            args = call.function.arguments
            check_weather_args(args)
            assert args == json.dumps(json.loads(args), ensure_ascii=False, separators=COMPACT)


COMPACT = (", ", ": ")


def test_response_format_beside_required_tools_is_a_call_or_an_answer(server, client) -> None:
    """An agent with tools and an output type (the Agents SDK sends both): one grammar, the
    union of the calls and the format; on chat and on /v1/responses."""
    city = {
        "type": "json_schema",
        "json_schema": {"name": "City", "schema": City.model_json_schema()},
    }
    for choice, seed in (("required", 1), ("auto", 2)):
        tools = (
            [WEATHER]
            if choice == "required"
            else [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}]
        )
        r = ask_for_a_tool(
            client,
            "SmolLM2-135M-Instruct",
            tools,
            choice,
            120,
            temperature=0.7,
            seed=seed,
            response_format=city,
        )
        msg = r.choices[0].message
        if msg.tool_calls:
            check_weather_args(msg.tool_calls[0].function.arguments)
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            City.model_validate_json(msg.content)
    resp = httpx.post(
        server.base + "/v1/responses",
        json={
            "input": ASK[0]["content"],
            "tools": [{"type": "function", **WEATHER["function"]}],
            "tool_choice": "required",
            "max_output_tokens": 120,
            "temperature": 0,
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "City",
                    "schema": City.model_json_schema(),
                }
            },
        },
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    items = resp.json()["output"]
    calls = [i for i in items if i["type"] == "function_call"]
    if calls:
        check_weather_args(calls[0]["arguments"])
    else:
        City.model_validate_json(items[0]["content"][0]["text"])


@pytest.mark.parametrize("max_tokens", [1, 3, 6])
@pytest.mark.parametrize("forced", ["required", "named"])
def test_a_forced_call_cut_before_its_name_is_still_that_call(server, client, forced, max_tokens):
    """The grammar determines the name (one tool under `required`, or a named tool_choice):
    cut by the token cap inside the call's opening, the answer is that call with the
    arguments generated so far and finish_reason length, on chat (whole and streamed) and
    Responses (an Agents SDK otherwise takes `None` as the final output)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(
        model="SmolLM2-135M-Instruct",
        messages=ASK,
        temperature=0,
        max_tokens=max_tokens,
        tools=[WEATHER] if forced == "required" else [WEATHER, TIME],
        tool_choice="required" if forced == "required" else named,
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and c.message.content is None, c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    streamed = {"name": None, "arguments": ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or []:
            streamed["name"] = streamed["name"] or (tc.function.name if tc.function else None)
            streamed["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assert not chunk.choices[0].delta.content
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}
    body = {
        "model": "SmolLM2-135M-Instruct",
        "input": ASK[0]["content"],
        "tools": [{"type": "function", **WEATHER["function"]}],
        "temperature": 0,
        "tool_choice": "required"
        if forced == "required"
        else {"type": "function", "name": "get_weather"},
        "max_output_tokens": max_tokens,
    }
    out = httpx.post(server.base + "/v1/responses", json=body, timeout=60).json()
    assert out["status"] == "incomplete", out
    assert [(i["type"], i.get("name")) for i in out["output"]] == [("function_call", "get_weather")]
