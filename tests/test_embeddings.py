"""Embeddings (/v1/embeddings, `LLM.embed`): the engine's pooled hidden states equal
transformers' (AutoModel's `last_hidden_state`, pooled and normalised), batch- and
chunk-invariant; then the route end to end through the `openai` SDK."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
import torch

from engine import LLM
from engine.runner.pooling import resolve_pooling
from tests.openai_schema import validate
from tests.server_utils import server_fixture

pytestmark = pytest.mark.slow  # a kvserve process and transformers

LENGTHS = [1, 5, 23, 40, 70, 131]


def prompts(vocab: int = 400) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def reference(model_dir, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers: the base model's last_hidden_state (after the final norm), pooled."""
    from transformers import AutoModel

    model = _hf_model(str(model_dir), AutoModel)
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=-1)


_HF: dict[str, torch.nn.Module] = {}


def _hf_model(path: str, auto):
    if path not in _HF:
        _HF[path] = auto.from_pretrained(path, torch_dtype=torch.float32).eval()
    return _HF[path]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def engines(request, model_dirs):
    """(model dir, an engine with a large token budget, one that chunks every prefill)."""
    path = str(model_dirs[request.param])
    whole = LLM(path, num_kv_blocks=64, block_size=16)
    chunked = LLM(path, num_kv_blocks=64, block_size=16, max_num_batched_tokens=16)
    return model_dirs[request.param], whole, chunked


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_matches_transformers_and_is_batch_invariant(engines, pooling) -> None:
    model_dir, whole, chunked = engines
    ps = prompts()
    batched = whole.embed(ps, pooling=pooling)
    batched_chunked = chunked.embed(ps, pooling=pooling)
    for ids, vec, vec_chunked in zip(ps, batched, batched_chunked):
        ref = reference(model_dir, ids, pooling)
        assert vec.shape == ref.shape and vec.dtype == torch.float32
        assert abs(vec.norm().item() - 1.0) < 1e-5
        assert torch.dot(vec, ref).item() > 0.9999, len(ids)
        alone = whole.embed([ids], pooling=pooling)[0]
        assert (alone - vec).abs().max().item() < 1e-5, len(ids)
        assert (alone - vec_chunked).abs().max().item() < 1e-5, len(ids)
    for llm in (whole, chunked):  # no request left, no block held (cached ones are free)
        assert not llm.engine.has_unfinished()
        assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_prefix_cache_hits_keep_the_vector(engines) -> None:
    """A shared 48-token prefix is cached by the first request; a second request hits it under
    last pooling (same vector as cold), and takes no hit under mean pooling."""
    _, whole, _ = engines
    shared = prompts()[4][:48]
    ids = shared + [7, 8, 9]
    for pooling in ("last", "mean"):
        whole.engine.reset_prefix_cache()
        cold = whole.embed([ids], pooling=pooling)[0]
        hits_before = whole.engine.kv.prefix_hits
        warm = whole.embed([ids], pooling=pooling)[0]
        hit = whole.engine.kv.prefix_hits - hits_before
        assert hit == (48 if pooling == "last" else 0)
        assert (cold - warm).abs().max().item() < 1e-5


def test_embeddings_mix_with_generation(engines) -> None:
    """Embedding and generating requests share steps; generation is unchanged by them."""
    from engine import SamplingParams

    _, whole, _ = engines
    ps = prompts()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    alone = whole.generate(ps[:3], greedy)
    engine = whole.engine
    for i, ids in enumerate(ps[:3]):
        engine.add_request(f"g{i}", ids, greedy)
        engine.add_request(f"e{i}", ids, SamplingParams(max_tokens=1, pooling="mean"))
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, torch.Tensor] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.embedding is not None:
                assert out.finished and out.finish_reason == "stop"
                vectors[out.request_id] = out.embedding
    for i in range(3):
        assert tokens[f"g{i}"] == alone[i].outputs[0].token_ids
        assert tokens[f"e{i}"] == [] and f"e{i}" in vectors


def test_pooling_from_sentence_transformers_config(tmp_path) -> None:
    assert resolve_pooling(str(tmp_path)) == "last"
    (tmp_path / "1_Pooling").mkdir()
    cfg = {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    assert resolve_pooling(str(tmp_path)) == "mean"
    assert resolve_pooling(str(tmp_path), "last") == "last"
    cfg = {"pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    assert resolve_pooling(str(tmp_path)) == "last"
    with pytest.raises(ValueError):
        resolve_pooling(str(tmp_path), "cls")


# ---- the route, end to end -------------------------------------------------------------------

MAX_LEN = 128
server = server_fixture(num_kv_blocks=64, block_size=16, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base + "/v1/embeddings", json=body, timeout=60)


def tokenize(server, text: str) -> list[int]:
    r = httpx.post(server.base + "/tokenize", json={"prompt": text}, timeout=60)
    return r.json()["tokens"]


def test_sdk_strings_lists_and_token_ids(server, client, llama_dir) -> None:
    texts = ["The quick brown fox", "Hello world! How are you today?", "def add(a, b):"]
    one = client.embeddings.create(model="llama", input=texts[0])  # the SDK asks for base64
    many = client.embeddings.create(model="llama", input=texts)
    assert [d.index for d in many.data] == [0, 1, 2]
    ids = [tokenize(server, t) for t in texts]
    by_ids = client.embeddings.create(model="llama", input=ids, encoding_format="float")
    single_ids = client.embeddings.create(model="", input=ids[1], encoding_format="float")
    assert many.usage.prompt_tokens == many.usage.total_tokens == sum(map(len, ids))
    assert one.usage.prompt_tokens == len(ids[0])
    first = torch.tensor(one.data[0].embedding)
    assert first.shape == (64,) and abs(first.norm().item() - 1) < 1e-5
    for i in range(3):
        vec = torch.tensor(many.data[i].embedding)
        assert (vec - torch.tensor(by_ids.data[i].embedding)).abs().max() < 1e-5
        ref = reference(llama_dir, ids[i], "last")  # the fixture has no pooling config: last
        assert torch.dot(vec, ref).item() > 0.9999
    assert (first - torch.tensor(many.data[0].embedding)).abs().max() < 1e-5
    assert (
        torch.tensor(single_ids.data[0].embedding) - torch.tensor(by_ids.data[1].embedding)
    ).abs().max() < 1e-5


def test_raw_body_matches_openai_schema_and_base64(server) -> None:
    body = {"input": ["a cat", "a dog"], "model": "llama", "user": "u1"}
    r = post(server, body)
    assert r.status_code == 200, r.text
    plain = r.json()
    validate("CreateEmbeddingResponse", plain)
    assert plain["object"] == "list" and plain["model"] == "llama"
    assert all(d["object"] == "embedding" for d in plain["data"])
    assert "user='u1'" in server.log()  # the end-user id is attributed in the request's log line
    r = post(server, {**body, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    for d, p in zip(r.json()["data"], plain["data"]):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert decoded.shape == (64,)
        assert np.abs(decoded - np.array(p["embedding"], dtype=np.float32)).max() < 1e-7


def test_dimensions_truncate_and_renormalise(client) -> None:
    full = client.embeddings.create(model="llama", input="Paris is the capital of France.")
    short = client.embeddings.create(
        model="llama", input="Paris is the capital of France.", dimensions=16
    )
    f, s = torch.tensor(full.data[0].embedding), torch.tensor(short.data[0].embedding)
    assert s.shape == (16,) and abs(s.norm().item() - 1) < 1e-5
    assert (s - torch.nn.functional.normalize(f[:16], dim=0)).abs().max() < 1e-5
    same = client.embeddings.create(model="llama", input="Paris", dimensions=64)
    assert len(same.data[0].embedding) == 64


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["fine", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": list(range(3, 3 + MAX_LEN + 1))}, "input"),
        ({"input": [5, 100000]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 65}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "user": 3}, "user"),
    ],
)
def test_bad_requests_name_the_param(server, body, param) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_sdk_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="llama", input="x", dimensions=1000)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="llama", input=[list(range(3, 3 + MAX_LEN + 5))])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other-model", input="x")


def test_embeddings_beside_generation_leave_no_blocks(server, client) -> None:
    import concurrent.futures

    def chat() -> str:
        r = client.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        return r.choices[0].finish_reason

    def embed() -> int:
        return len(client.embeddings.create(model="llama", input=["a b c"] * 8).data)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat), pool.submit(embed), pool.submit(embed), pool.submit(chat)]
        results = [f.result() for f in futures]
    assert results[1] == results[2] == 8
    stats = httpx.get(server.base + "/v1/stats", timeout=60).json()
    assert stats["blocks_in_use"] == 0
    spec = httpx.get(server.base + "/openapi.json", timeout=60).json()
    assert "/v1/embeddings" in spec["paths"]


def test_strings_keep_the_post_processors_suffix(llama_dir) -> None:
    """A tokenizer.json post-processor that appends a token (Qwen3-Embedding's <|endoftext|>)
    is kept for embedding inputs, as transformers' tokenizer(text) keeps it."""
    from tokenizers import processors

    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(llama_dir))
    plain = tok.encode("Paris is nice")
    assert tok.encode_for_embedding("Paris is nice") == plain  # no post-processor: unchanged
    eot = tok.token_to_id("<|endoftext|>")
    tok._backend.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)]
    )
    assert tok.encode_for_embedding("Paris is nice") == [*plain, eot]
