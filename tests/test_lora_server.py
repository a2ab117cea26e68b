"""LoRA adapters through HTTP with the openai SDK: a request picks an adapter by `model` and gets
PEFT's merged model's greedy tokens; /v1/models lists adapters with their base as parent;
adapters load and unload at run time under traffic, in vLLM's shapes, refused while in use; an
unknown name is a 404 and a bad file a 400, both in OpenAI's shape; per-application cache
statistics are kept per adapter."""

from __future__ import annotations

import concurrent.futures
import threading

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.lora_utils import make_adapter, merged_model, reference_greedy
from tests.server_utils import kvserve_server

KEY = "lora-key"
PROMPT = [5, 17, 99, 3, 44, 8, 120, 7, 61, 33, 11, 250, 18]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora-http")
    return {
        "a": make_adapter(llama_dir, root / "a", seed=1),
        "b": make_adapter(llama_dir, root / "b", seed=2, r=8, targets=["q_proj", "v_proj"]),
        "c": make_adapter(llama_dir, root / "c", seed=4, targets=["gate_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    with kvserve_server(
        llama_dir,
        dtype="float32",
        num_kv_blocks=128,
        block_size=16,
        api_key=KEY,
        served_model_name="base",
        lora_modules=[f"a={adapters['a']}"],
        max_loras=2,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(server.base + path, json=body, headers=headers, timeout=60)


def completion(client, model: str, n: int = 8, prompt=PROMPT) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_an_adapter_by_model_name_equals_peft_merged(client, llama_dir, adapters) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    for name in ("base", "a"):
        model = merged_model(llama_dir, adapters["a"] if name == "a" else None)
        want, _ = reference_greedy(model, PROMPT, 8)
        # (a trailing incomplete UTF-8 sequence is held back by the server's detokenizer)
        assert completion(client, name) == tok.decode(want).rstrip("\ufffd")
    assert completion(client, "a") != completion(client, "base")


def test_models_lists_adapters_with_their_parent(client, adapters) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"base", "a"}
    assert cards["a"].parent == "base" and cards["a"].root == str(adapters["a"])
    assert cards["base"].parent is None
    assert client.models.retrieve("a").parent == "base"


def test_unknown_model_is_a_404_in_openai_shape(client) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        completion(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_load_and_unload_at_run_time_under_traffic(server, client, adapters) -> None:
    alone = {name: completion(client, name, 16) for name in ("base", "a")}
    stop = threading.Event()
    seen: list[tuple[str, str]] = []

    def traffic() -> None:
        while not stop.is_set():
            for name in ("base", "a"):
                seen.append((name, completion(client, name, 16)))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        workers = [pool.submit(traffic) for _ in range(2)]
        r = post(
            server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["b"])}
        )
        assert r.status_code == 200 and "added successfully" in r.text
        b_text = completion(client, "b", 16)
        stop.set()
        for w in workers:
            w.result()
    assert seen and all(text == alone[name] for name, text in seen)
    assert b_text not in alone.values()
    assert "b" in {m.id for m in client.models.list().data}
    again = post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "/x"})
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_exists"
    # in use: a 409 until its request ends
    stream = client.completions.create(
        model="b",
        prompt=PROMPT,
        max_tokens=64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    busy = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "lora_in_use"
    assert len(list(stream)) > 1
    done = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert done.status_code == 200, done.text
    with pytest.raises(openai.NotFoundError):
        completion(client, "b")
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_not_found"


def test_at_most_max_loras_adapters_at_once_over_http(server, client, adapters) -> None:
    """Three adapters (max_loras 2) asked for together: every request is served, each
    adapter's answer as it is alone."""
    for name, path in (("c", adapters["c"]), ("b2", adapters["b"])):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 200, r.text
    names = ["a", "c", "b2", "base"] * 2
    alone = {name: completion(client, name, 12) for name in set(names)}
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: completion(client, n, 12), names))
    assert got == [alone[n] for n in names]
    assert len(set(alone.values())) == 4


def test_bad_adapter_files_are_400s_and_the_server_serves_on(server, client, tmp_path) -> None:
    (tmp_path / "adapter_config.json").write_text("{not json")
    for path in (str(tmp_path), "/no/such/adapter"):
        r = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_lora", r.text
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "bad"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    unauthorised = httpx.post(
        server.base + "/v1/load_lora_adapter",
        timeout=10,
        json={"lora_name": "x", "lora_path": "/x"},
    )
    assert unauthorised.status_code == 401
    assert completion(client, "a")


def test_cache_statistics_per_adapter(client, server) -> None:
    prompt = list(range(100, 180))
    for name in ("a", "a", "base"):
        completion(client, name, 2, prompt)
    stats = httpx.get(
        server.base + "/v1/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    ).json()
    apps = stats["apps"]
    (name,) = [k for k in apps if k.endswith("@a")]
    assert apps[name]["cached_tokens"] > 0  # its second request hit its first's blocks
    base = [k for k in apps if "@" not in k]
    assert base and all(apps[k]["prompt_tokens"] > 0 for k in base)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]),
    body=st.one_of(
        st.dictionaries(
            st.sampled_from(["lora_name", "lora_path", "lora_int_id", "x"]),
            st.one_of(st.text(max_size=40), st.integers(), st.none(), st.lists(st.integers())),
        ),
        st.lists(st.integers(), max_size=3),
        st.text(max_size=20),
    ),
)
def test_hostile_lora_bodies_are_4xx_never_5xx(server, client, path, body) -> None:
    r = post(server, path, body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert r.json()["error"]["message"]
    if r.status_code == 200 and path.endswith("load_lora_adapter"):  # a real path loaded
        post(server, "/v1/unload_lora_adapter", {"lora_name": body["lora_name"]})
    assert completion(client, "a", 2)


def test_every_generation_route_serves_the_adapter(server, client) -> None:
    """Chat, Responses and Anthropic Messages pick the adapter by `model` and answer as it."""
    import anthropic

    msgs = [{"role": "user", "content": "hello there"}]
    chat = {
        m: client.chat.completions.create(model=m, messages=msgs, max_tokens=8, temperature=0)
        for m in ("base", "a")
    }
    assert chat["a"].model == "a" and chat["base"].model == "base"
    text = chat["a"].choices[0].message.content
    resp = client.responses.create(
        model="a", input="hello there", max_output_tokens=8, temperature=0
    )
    assert resp.model == "a" and resp.output_text == text
    claude = anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)
    msg = claude.messages.create(
        model="a", max_tokens=8, messages=msgs, extra_body={"temperature": 0.0}
    )
    assert msg.model == "a" and "".join(b.text for b in msg.content if b.type == "text") == text
    forced = {m: completion(client, m, 8, "hello there") for m in ("base", "a")}
    assert forced["a"] != forced["base"]
