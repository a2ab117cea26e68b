"""Fault isolation: one request's failure stays with that request; a dead engine is loud; SIGTERM
drains. In-process servers (uvicorn in a thread) let tests inject faults into the live engine."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
import torch

from harness import sse
from tests.openai_schema import validate
from tests.server_utils import InProcessServer, ServerProcess, kvserve_server, nan_logits

pytestmark = pytest.mark.slow  # in-process and subprocess servers

MARKER = 399  # a prompt token that makes the injected NaN fault fire


@pytest.fixture()
def live(llama_dir):
    s = InProcessServer(llama_dir)
    yield s
    s.stop()


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def test_tokenizer_failure_fails_only_that_request(live, monkeypatch) -> None:
    tok = live.core.tokenizer
    original = tok.encode

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if "EXPLODE" in text:
            raise RuntimeError("tokenizer blew up")
        return original(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", encode)
    bad = post(live.base, "/v1/completions", {"prompt": "EXPLODE now", "max_tokens": 2})
    assert bad.status_code == 500
    validate("ErrorResponse", bad.json())
    assert "request id" in bad.json()["error"]["message"]
    assert "EXPLODE" not in bad.text  # no prompt text in errors
    good = post(live.base, "/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert good.status_code == 200


def test_nan_logits_fail_only_their_request(live, monkeypatch) -> None:
    runner = live.core.runner
    original = runner.forward

    def execute(out):
        logits, hidden, plan = original(out)
        logits = logits.clone()
        rows = [s.request for s in out.scheduled if s.samples]
        for i, r in enumerate(rows):
            if MARKER in r.prompt_token_ids:
                logits[i] = float("nan")
        return logits, hidden, plan

    monkeypatch.setattr(runner, "forward", execute)
    results: dict[str, httpx.Response] = {}

    def send(name: str, prompt: list[int]) -> None:
        results[name] = post(
            live.base, "/v1/completions", {"prompt": prompt, "max_tokens": 20, "ignore_eos": True}
        )

    threads = [
        threading.Thread(target=send, args=("bad", [5, MARKER, 7])),
        threading.Thread(target=send, args=("good", [5, 6, 7])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["bad"].status_code == 500
    assert "NaN" in results["bad"].json()["error"]["message"]
    assert results["good"].status_code == 200
    assert results["good"].json()["usage"]["completion_tokens"] == 20
    assert live.core.kv.pool.num_free_blocks == live.core.num_blocks
    with httpx.stream(
        "POST",
        live.base + "/v1/completions",
        timeout=60,
        json={"prompt": [MARKER], "max_tokens": 5, "stream": True},
    ) as r:
        payloads = list(sse.data(r))
    assert "error" in json.loads(payloads[-2]) and payloads[-1] == sse.DONE


def test_dead_engine_thread_is_loud(live, monkeypatch) -> None:
    sched = live.core.scheduler
    original = sched.schedule
    armed = threading.Event()

    def schedule():
        if armed.is_set():
            raise RuntimeError("scheduler bug")
        return original()

    monkeypatch.setattr(sched, "schedule", schedule)
    events = []
    with httpx.stream(
        "POST",
        live.base + "/v1/completions",
        timeout=60,
        json={"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True},
    ) as r:
        for payload in sse.data(r):
            events.append(payload)
            if len(events) == 3:
                armed.set()
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert httpx.get(live.base + "/health").status_code == 503
    assert len(live.fatal) == 1
    later = post(live.base, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert later.status_code == 503


def _stream_in_thread(
    s: ServerProcess, max_tokens: int, events: list[str], started: threading.Event
) -> threading.Thread:
    def stream() -> None:
        with httpx.stream(
            "POST",
            s.base + "/v1/completions",
            timeout=120,
            json={"prompt": "go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True},
        ) as r:
            for payload in sse.data(r):
                events.append(payload)
                if len(events) == 5:
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    return t


def _sigterm_mid_stream(
    llama_dir, grace_s: float, max_tokens: int
) -> tuple[ServerProcess, threading.Thread, list[str]]:
    """A server with `grace_s` of shutdown grace gets SIGTERM while a stream of `max_tokens`
    runs; returns it, the streaming thread and the stream's events so far."""
    s = kvserve_server(llama_dir, num_kv_blocks=128, max_model_len=4096, shutdown_grace_s=grace_s)
    events: list[str] = []
    started = threading.Event()
    t = _stream_in_thread(s, max_tokens, events, started)
    assert started.wait(60)
    s.proc.send_signal(signal.SIGTERM)
    return s, t, events


def test_sigterm_drains_in_flight_and_refuses_new(llama_dir) -> None:
    # The grace is far beyond the request (2,000 tokens: ~3 s here) and the test waits on the
    # server's state, not the clock, so a machine shared with other work cannot fail it.
    s, t, events = _sigterm_mid_stream(llama_dir, grace_s=900, max_tokens=2000)
    deadline = time.monotonic() + 60
    while httpx.get(s.base + "/health").json()["status"] != "draining":
        assert time.monotonic() < deadline, "SIGTERM never started the drain"
        time.sleep(0.02)
    late = httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert late.status_code == 503
    t.join(timeout=900)
    assert s.proc.wait(timeout=60) == 0
    assert events[-1] == "[DONE]"
    finals = [json.loads(e) for e in events[:-1]]
    assert "error" not in finals[-1], finals[-1]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    s.stop()


def test_sigterm_grace_expiry_aborts_with_error_event(llama_dir) -> None:
    s, t, events = _sigterm_mid_stream(llama_dir, grace_s=0.5, max_tokens=4000)
    t.join(timeout=60)
    assert s.proc.wait(timeout=60) == 0
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    s.stop()


def test_nan_guard_sanity() -> None:
    assert not torch.isfinite(torch.tensor([float("nan")])).all()


def test_request_timeout_aborts_cleanly(llama_dir) -> None:
    # 1 s: a 4,000-token request needs ~4 s here (it would have to run 4x faster to finish), a
    # 2-token one ~2 ms (the machine would have to stall it 500x to time it out).
    s = kvserve_server(llama_dir, num_kv_blocks=128, max_model_len=4096, request_timeout_s=1.0)
    try:
        body = {"prompt": "go", "max_tokens": 4000, "ignore_eos": True}
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 504
        validate("ErrorResponse", r.json())
        with httpx.stream(
            "POST", s.base + "/v1/completions", timeout=60, json={**body, "stream": True}
        ) as resp:
            events = list(sse.data(resp))
        assert events[-1] == "[DONE]" and "exceeded" in json.loads(events[-2])["error"]["message"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            m = httpx.get(s.base + "/metrics").text
            if "kvserve:num_requests_running 0.0" in m:
                break
            time.sleep(0.1)
        assert "kvserve:num_requests_running 0.0" in m
        assert "kvserve:kv_cache_usage_perc 0.0" in m
        ok = httpx.post(s.base + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    finally:
        s.stop()


def test_a_failed_response_stream_ends_with_response_failed(live, monkeypatch) -> None:
    """Responses API: a generation that fails mid-stream ends with a schema-valid
    `response.failed` event, stores nothing and frees its blocks."""
    nan_logits(monkeypatch, live.core.runner)
    body = {"input": "hello", "max_output_tokens": 5, "stream": True}
    with httpx.stream("POST", live.base + "/v1/responses", json=body, timeout=60) as r:
        events = [json.loads(payload) for payload in sse.data(r)]
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    validate("ResponseFailedEvent", events[-1])
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "NaN" in failed["error"]["message"]
    assert httpx.get(f"{live.base}/v1/responses/{failed['id']}").status_code == 404
    assert live.core.kv.pool.num_free_blocks == live.core.num_blocks
