"""One hostile request never takes its batch-mates down (#66): a grammar that admits nothing is
a 400 at compile time; one whose language runs out mid-way ends its request with a 400 while
the others stream on; a step input outside the vocabulary fails its request before the forward;
a forward that fails anyway is retried without the request that made it fail. The healthy
streams' text equals what each gives alone, and no KV block leaks."""

from __future__ import annotations

import threading

import httpx
import pytest
from openai import OpenAI

from engine.core.batch import ScheduledRequest
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.step_guard import invalid_inputs
from tests.server_utils import InProcessServer

POISON = 433  # a prompt token that makes the injected forward fault fire
HEALTHY = [f"Story number {i} begins with" for i in range(8)]


@pytest.fixture(scope="module")
def live(llama_dir):
    s = InProcessServer(llama_dir, engine={"num_speculative_tokens": 0})
    yield s
    s.stop()


def _stream(client: OpenAI, prompt: str) -> str:
    chunks = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _alongside(base: str, hostile: list[dict]) -> tuple[list[str], list[httpx.Response]]:
    """The 8 healthy streams, started together with the hostile bodies."""
    client = OpenAI(base_url=base + "/v1", api_key="x")
    texts: list[str] = [""] * len(HEALTHY)
    answers: list[httpx.Response] = []

    def healthy(i: int) -> None:
        texts[i] = _stream(client, HEALTHY[i])

    def send(body: dict) -> None:
        answers.append(httpx.post(base + "/v1/chat/completions", json=body, timeout=120))

    threads = [threading.Thread(target=healthy, args=(i,)) for i in range(len(HEALTHY))]
    threads += [threading.Thread(target=send, args=(body,)) for body in hostile]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts, answers


def _chat(content: str, **extra: object) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 12, **extra}


@pytest.mark.slow
def test_hostile_constraints_fail_alone_amid_eight_streams(live) -> None:
    client = OpenAI(base_url=live.base + "/v1", api_key="x")
    alone = [_stream(client, p) for p in HEALTHY]
    hostile = [
        # the language is empty: nothing to generate, known when it compiles
        _chat("hi", structured_outputs={"grammar": "root ::= root"}),
        # only the end is allowed, and min_tokens forbids the end: nothing at the first step
        _chat("hi", structured_outputs={"grammar": 'root ::= ""'}, min_tokens=3),
        # the same under sampling
        _chat("yo", structured_outputs={"grammar": 'root ::= ""'}, min_tokens=3, temperature=1),
    ]
    texts, answers = _alongside(live.base, hostile)
    assert texts == alone
    assert sorted(a.status_code for a in answers) == [400, 400, 400], [a.text for a in answers]
    codes = {a.json()["error"]["code"] for a in answers}
    assert codes == {"invalid_value", "no_token_allowed"}, codes
    assert live.core.kv.pool.num_free_blocks == live.core.num_blocks


@pytest.mark.slow
def test_a_failing_forward_is_retried_without_the_request_that_made_it_fail(
    live, monkeypatch
) -> None:
    client = OpenAI(base_url=live.base + "/v1", api_key="x")
    alone = [_stream(client, p) for p in HEALTHY]
    model = live.core.runner.model
    original = model.forward

    def forward(input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            raise RuntimeError("a kernel fault on this request's rows")
        return original(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    poisoned = {"prompt": [5, POISON, 7], "max_tokens": 4}
    texts, answers = _alongside_completion(live.base, poisoned)
    assert texts == alone
    assert [a.status_code for a in answers] == [500]
    assert "forward pass failed" in answers[0].json()["error"]["message"]
    assert live.core.kv.pool.num_free_blocks == live.core.num_blocks


def _alongside_completion(base: str, body: dict) -> tuple[list[str], list[httpx.Response]]:
    client = OpenAI(base_url=base + "/v1", api_key="x")
    texts: list[str] = [""] * len(HEALTHY)
    answers: list[httpx.Response] = []

    def healthy(i: int) -> None:
        texts[i] = _stream(client, HEALTHY[i])

    def send() -> None:
        answers.append(httpx.post(base + "/v1/completions", json=body, timeout=120))

    threads = [threading.Thread(target=healthy, args=(i,)) for i in range(len(HEALTHY))]
    threads.append(threading.Thread(target=send))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return texts, answers


def test_step_tokens_outside_the_vocabulary_fail_their_request_before_the_forward() -> None:
    params = SamplingParams(max_tokens=8)

    def request(name: str, outputs: list[int], drafts: list[int]) -> ScheduledRequest:
        r = Request(name, [1, 2, 3], params, frozenset({0}), 64)
        r.all_token_ids.extend(outputs)
        r.num_computed_tokens = 3 + len(outputs) - 1
        r.spec_token_ids = drafts
        return ScheduledRequest(r, 1 + len(drafts), len(drafts))

    good = request("good", [7], [8, 9])
    bad_draft = request("bad-draft", [7], [8, 100])
    bad_output = request("bad-output", [-1], [])
    found = invalid_inputs([good, bad_draft, bad_output], vocab=100)
    assert [(r.request_id, "outside the vocabulary" in why) for r, why in found] == [
        ("bad-draft", True),
        ("bad-output", True),
    ]
