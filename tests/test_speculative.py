"""EAGLE speculative decoding must be lossless: greedy tokens identical with and without it (mixed
batches, chunked prefill, prefix hits, preemption), and sampled tokens distributed as without it.

Draft heads are written by the tests in the published key names:
- `identity` (EAGLE-1): fc = [0 | I] and zero attention/MLP outputs, so the draft's "next feature"
  is the current one, i.e. it proposes what the target predicted one position earlier. A poor
  draft that still overlaps the target's distribution, so accept and reject paths both run.
- `random` (EAGLE-1 with fc bias, and EAGLE-3 with d2t): random weights, drafts mostly rejected.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams

H, HEADS, INTER, VOCAB = 64, 4, 128, 512  # conftest's tiny llama


def _config(path: Path, extra: dict | None = None) -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": H,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
    }
    cfg.update(extra or {})
    (path / "config.json").write_text(json.dumps(cfg))


def _layer(prefix: str, attn_in: int, gen: torch.Generator, zero_out: bool) -> dict:
    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    kv = 2 * (H // HEADS)
    t = {
        f"{prefix}self_attn.q_proj.weight": r(H, attn_in),
        f"{prefix}self_attn.k_proj.weight": r(kv, attn_in),
        f"{prefix}self_attn.v_proj.weight": r(kv, attn_in),
        f"{prefix}self_attn.o_proj.weight": r(H, H),
        f"{prefix}mlp.gate_proj.weight": r(INTER, H),
        f"{prefix}mlp.up_proj.weight": r(INTER, H),
        f"{prefix}mlp.down_proj.weight": r(H, INTER),
        f"{prefix}post_attention_layernorm.weight": 1 + r(H) * 0.5,
    }
    if zero_out:
        t[f"{prefix}self_attn.o_proj.weight"].zero_()
        t[f"{prefix}mlp.down_proj.weight"].zero_()
    return t


def write_eagle1(path: Path, identity: bool, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    t = _layer("layers.0.", H, gen, zero_out=identity)
    fc = torch.randn(H, 2 * H, generator=gen) * 0.2
    if identity:
        fc = torch.cat([torch.zeros(H, H), torch.eye(H)], dim=1)
    t["fc.weight"] = fc
    if not identity:
        t["fc.bias"] = torch.randn(H, generator=gen) * 0.1
        t["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=gen)  # saved by some heads
    save_file(t, str(path / "model.safetensors"))
    _config(path)
    return path


def write_eagle3(path: Path, seed: int = 0, draft_vocab: int = 128) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    t = _layer("midlayer.", 2 * H, gen, zero_out=False)
    t["midlayer.input_layernorm.weight"] = torch.ones(H)
    t["midlayer.hidden_norm.weight"] = torch.ones(H)
    t["fc.weight"] = torch.randn(H, 3 * H, generator=gen) * 0.2
    t["norm.weight"] = torch.ones(H)
    t["lm_head.weight"] = torch.randn(draft_vocab, H, generator=gen) * 0.2
    ids = torch.sort(torch.randperm(VOCAB, generator=gen)[:draft_vocab]).values
    t["d2t"] = ids - torch.arange(draft_vocab)
    t["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    torch.save(t, path / "pytorch_model.bin")  # the other published file format
    _config(
        path,
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft_vocab,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]},  # 2-layer target
        },
    )
    return path


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {
        "identity": write_eagle1(root / "identity", identity=True),
        "random": write_eagle1(root / "random", identity=False),
        "eagle3": write_eagle3(root / "eagle3"),
    }


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 400) for _ in range(40)]
    out = []
    for i in range(n):
        own = [rng.randrange(3, 400) for _ in range(rng.randrange(1, 60))]
        out.append(shared[: rng.randrange(0, 40)] + own if i % 2 else own)
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# adaptive k never shrinks k at these batch sizes
PIN_K = {"spec_max_verify_rows": 1 << 16, "spec_cost_model": False}


def spec_llm(model: Path, head: Path, k: int, **kw) -> LLM:
    """An engine speculating with `head`, k drafts pinned; small blocks to exercise paging."""
    opts = {"num_kv_blocks": 256, "block_size": 4, "speculative_method": "eagle", **PIN_K, **kw}
    return LLM(str(model), speculative_model=str(head), num_speculative_tokens=k, **opts)


@pytest.fixture(scope="module")
def reference(llama_dir) -> tuple[list[list[int]], list[list[int]]]:
    ps = prompts(12)
    llm = LLM(str(llama_dir), num_kv_blocks=256, block_size=4)
    outs = [r.outputs[0].token_ids for r in llm.generate(ps, GREEDY)]
    return ps, outs


@pytest.mark.parametrize("head", ["identity", "random", "eagle3"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill
        {"num_kv_blocks": 40},  # preemption
    ],
    ids=["batch", "chunked", "preempt"],
)
def test_greedy_identical(llama_dir, heads, reference, head, kw) -> None:
    ps, ref = reference
    llm = spec_llm(llama_dir, heads[head], 3, **kw)
    outs = [r.outputs[0].token_ids for r in llm.generate(ps, GREEDY)]
    assert outs == ref
    stats = llm.engine.drafter.stats["eagle"]
    assert stats.num_draft_tokens > 0
    assert llm.engine.kv.prefix_hits > 0  # shared prefixes hit; the draft's KV came along
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.pool.num_free_blocks == kw.get("num_kv_blocks", 256)


def test_oracle_drafts_accept_and_stay_identical(llama_dir, heads, reference, monkeypatch) -> None:
    """Drafts replaced by the reference continuation (mostly right, sometimes corrupted) drive
    long acceptances, bonus tokens, max_tokens and stop-token endings inside a verified chunk."""
    ps, ref = reference
    llm = spec_llm(llama_dir, heads["random"], 4)
    proposer = llm.engine.drafter.eagle
    expected = {}
    original = proposer._draft_tokens
    rng = random.Random(0)

    def oracle(hidden, reqs, live, *rest):
        out = original(hidden, reqs, live, *rest)
        for i in live:
            r = reqs[i]
            cont = expected[r.request_id]
            j = r.num_output_tokens + len(r.spec_token_ids) - 1
            if j < len(cont) and rng.random() < 0.85:
                r.spec_token_ids[-1] = out[i] = cont[j]
        return out

    monkeypatch.setattr(proposer, "_draft_tokens", oracle)
    stops = [ref[i][10] for i in range(len(ps))]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stops[i]])
        if i % 3 == 0
        else SamplingParams(temperature=0.0, max_tokens=5 + i, ignore_eos=True)
        for i in range(len(ps))
    ]
    for i in range(len(ps)):
        expected[str(i)] = ref[i]
    outs = [r.outputs[0].token_ids for r in llm.generate(ps, params)]
    for i, out in enumerate(outs):
        if i % 3 == 0:
            assert out == ref[i][: ref[i].index(stops[i]) + 1]
        else:
            assert out == ref[i][: 5 + i]
    stats = llm.engine.drafter.stats["eagle"]
    assert stats.mean_acceptance_length > 2.0
    assert stats.accepted_per_position[3] > 0  # full acceptances: bonus tokens
    assert llm.engine.kv.pool.num_free_blocks == 256


def test_penalties_bias_logprobs_match(llama_dir, heads, monkeypatch) -> None:
    """Processors see each verified row's drafted prefix; logprobs come from the target."""
    ps = prompts(6, seed=3)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        logit_bias={7: 3.0, 11: -50.0},
        min_tokens=5,
        logprobs=3,
    )
    plain = LLM(str(llama_dir), num_kv_blocks=256, block_size=4).generate(ps, params)
    spec = spec_llm(llama_dir, heads["identity"], 3).generate(ps, params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) < 1e-3
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_sampling_distribution_unchanged(llama_dir, heads) -> None:
    """Second-token frequencies over 3000 seeded requests, with and without a poor draft: a
    chi-square two-sample test at p > 0.001 (the threshold; a wrong acceptance rule, e.g.
    accepting every draft, fails it by orders of magnitude)."""
    prompt = [5, 17, 42, 99]
    n = 3000
    kw = {"num_kv_blocks": 1024, "block_size": 4, "max_num_seqs": 512}
    params = [
        SamplingParams(temperature=3.0, top_p=0.9, max_tokens=3, ignore_eos=True, seed=i)
        for i in range(n)
    ]
    plain = LLM(str(llama_dir), **kw).generate([prompt] * n, params)
    speculating = spec_llm(llama_dir, heads["identity"], 2, **kw)
    spec = speculating.generate([prompt] * n, params)
    stats = speculating.engine.drafter.stats["eagle"]
    assert stats.num_draft_tokens >= n  # every request verified drafts
    assert 0.1 * n < stats.num_accepted_tokens < 0.9 * n  # both paths ran often
    for pos in (1, 2):
        a = Counter(r.outputs[0].token_ids[pos] for r in plain)
        b = Counter(r.outputs[0].token_ids[pos] for r in spec)
        tokens = sorted(set(a) | set(b))
        assert chi_square_p(a, b, tokens) > 0.001, (pos, a.most_common(5), b.most_common(5))


def chi_square_p(a: Counter, b: Counter, tokens: list[int]) -> float:
    """p-value of Pearson's chi-square test that two samples share one distribution; tokens
    seen fewer than 20 times in all are pooled into one cell."""
    rare = [t for t in tokens if a[t] + b[t] < 20]
    tokens = [t for t in tokens if a[t] + b[t] >= 20]
    a = Counter({**{t: a[t] for t in tokens}, -1: sum(a[t] for t in rare)})
    b = Counter({**{t: b[t] for t in tokens}, -1: sum(b[t] for t in rare)})
    tokens = tokens + [-1]
    table = torch.tensor([[a[t] for t in tokens], [b[t] for t in tokens]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = torch.tensor(len(tokens) - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.slow
def test_server_flags_stream_and_metrics(llama_dir, heads, reference) -> None:
    """--speculative-model / --num-speculative-tokens through HTTP: greedy completions equal the
    engine's non-speculative tokens (streamed, several tokens per chunk), metrics report it."""
    import httpx

    from harness import sse
    from tests.server_utils import kvserve_server

    ps, _ = reference
    with kvserve_server(
        llama_dir,
        num_kv_blocks=256,
        block_size=4,
        speculative_model=heads["identity"],
        num_speculative_tokens=3,
        speculative_method="eagle",
        no_spec_cost_model=True,  # k pinned at 3 (the cost model would pick it by timing)
    ) as server:
        plain = LLM(str(llama_dir), num_kv_blocks=256, block_size=4)
        for prompt in ps[:4]:
            expected = plain.generate([prompt], GREEDY)[0].outputs[0].text
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.base + "/v1/completions", json=body | {"logprobs": 0}, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["completion_tokens"] == 24
            assert len(choice["logprobs"]["tokens"]) == 24
            assert choice["text"] == expected
            with httpx.stream(
                "POST", server.base + "/v1/completions", json=body | {"stream": True}, timeout=60
            ) as s:
                chunks = [json.loads(p)["choices"][0]["text"] for p in sse.data(s) if p != sse.DONE]
            assert "".join(chunks) == choice["text"]
        metrics = httpx.get(server.base + "/metrics", timeout=10).text
        assert "kvserve:spec_decode_num_draft_tokens_total" in metrics
        assert "kvserve:spec_decode_num_speculative_tokens 3.0" in metrics
        # /v1/stats: per source, and why each recent request sped up (the picker's choices)
        spec = httpx.get(server.base + "/v1/stats", timeout=10).json()["speculation"]
        assert spec["by_source"]["eagle"]["draft_tokens"] > 0
        recent = spec["recent_requests"]
        assert len(recent) == 8  # 4 prompts, whole and streamed
        for r in recent:
            assert r["steps"] > 0 and sum(r["share_by_source"].values()) == pytest.approx(
                1, abs=0.01
            )
            assert set(r["share_by_source"]) <= {"eagle", "none"} and "eagle" in r["acceptance"]
        assert any(r["share_by_source"].get("eagle", 0) > 0.5 for r in recent)


def test_stop_strings_inside_a_verified_chunk(llama_dir, heads, reference, monkeypatch) -> None:
    """A stop string matched among several accepted tokens ends the request there, before the
    draft head drafts from tokens that are then dropped: text and tokens equal the run without
    speculation, and every block comes back."""
    ps, ref = reference
    plain = LLM(str(llama_dir), num_kv_blocks=256, block_size=4)
    tok = plain.tokenizer
    stops = []
    for cont in ref:
        text = tok.decode(cont[6:12], skip_special_tokens=True)
        stops.append(text[len(text) // 2 :][:3] or "\x00")
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[s]) for s in stops
    ]
    want = [(r.outputs[0].text, r.outputs[0].token_ids) for r in plain.generate(ps, params)]
    llm = spec_llm(llama_dir, heads["random"], 4)
    proposer = llm.engine.drafter.eagle
    expected = {str(i): ref[i] for i in range(len(ps))}
    original = proposer._draft_tokens

    def oracle(
        hidden, reqs, live, *rest
    ):  # right drafts: long accepted chunks carry the stop string
        out = original(hidden, reqs, live, *rest)
        for i in live:
            r = reqs[i]
            j = r.num_output_tokens + len(r.spec_token_ids) - 1
            if j < len(expected[r.request_id]):
                r.spec_token_ids[-1] = out[i] = expected[r.request_id][j]
        return out

    monkeypatch.setattr(proposer, "_draft_tokens", oracle)
    results = llm.generate(ps, params)
    assert [(r.outputs[0].text, r.outputs[0].token_ids) for r in results] == want
    assert sum(1 for r in results if r.outputs[0].finish_reason == "stop") > 6
    assert llm.engine.drafter.stats["eagle"].mean_acceptance_length > 2.0
    assert llm.engine.kv.pool.num_free_blocks == 256


def test_no_shipped_head_for_another_model_is_refused(llama_dir) -> None:
    """Without speculative_model, a head is used only if one was trained for these weights."""
    with pytest.raises(ValueError, match="no shipped head was trained for this model"):
        LLM(str(llama_dir), num_kv_blocks=64, num_speculative_tokens=2, speculative_method="eagle")


def test_cost_model_picks_k_by_measured_costs() -> None:
    """Memory-bound verification (5 rows cost 1 row's time) makes k = 4 pay at batch 1; at
    batch 16 every extra row costs its full price. A head's first draft comes with the catch-up
    it runs every step: where a verify row is free it is always worth taking (and keeps the
    request's acceptance measured, so a head that recovers is noticed), while a chain step for
    drafts that are rarely accepted costs more than it returns."""
    from engine.spec.cost import SpecCostModel

    rows = (1, 2, 4, 8, 16, 32, 64)
    model = SpecCostModel(rows, tuple(0.010 * max(1, r / 8) for r in rows), (0.001,) * len(rows))
    assert model.best_k(1, 0.7, 4, 64) == 4
    assert model.best_k(16, 0.7, 4, 64) == 0
    assert model.best_k(1, 0.05, 4, 64) == 1
    assert model.best_k(1, 0.0, 4, 64) == 0
    assert model.chain(3, 1) == 0.0 and model.chain(3, 3) == pytest.approx(0.002)
    assert model.best_k(4, 0.7, 4, 8) == 1  # the row cap still bounds it
    assert model.target(128) == pytest.approx(0.160)  # extrapolated past the last measurement


def test_the_picker_turns_drafting_down_as_served_verify_rows_grow_dear() -> None:
    """Startup costs flat to 256 rows (memory-bound on a quiet pool) make 3 suffix drafts each
    look free at batch 64; served verify steps of 256 rows at 4x their prediction (as compute
    bound as 4 steps of 64), beside
    64-row decode steps as predicted, turn drafting off at batch 64, while batch 2 (its rows
    served as predicted) still drafts. Left undrafted, the dear bucket relaxes toward what is
    served below it, so drafting is tried again later."""
    from engine.spec.cost import SpecCostModel
    from engine.spec.drafting import Drafter

    rows = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    flat = SpecCostModel(rows, (0.020,) * len(rows), (0.0,) * len(rows))
    drafter = Drafter(("suffix",), 3, 1 << 16, flat)
    picks = lambda n: [("suffix", [5, 6, 7], 0.6)] * n  # noqa: E731
    assert drafter.step_k(picks(64)) == 3 and drafter.step_k(picks(2)) == 3
    for _ in range(5):
        drafter.observe_step(256, 0.080)  # 64 requests x (1 + 3) verify rows
        drafter.observe_step(64, 0.020)
        drafter.observe_step(4, 0.020)
    assert drafter.step_k(picks(64)) == 0
    assert drafter.current_k == 0
    assert drafter.step_k(picks(2)) == 3  # 8 verify rows served as predicted
    for _ in range(300):  # undrafted decode steps of 64 rows, served as predicted
        drafter.observe_step(64, 0.020)
    assert drafter.step_k(picks(64)) == 3


def test_noisy_startup_costs_do_not_make_drafting_look_free() -> None:
    """A start beside two CPU burners timed 1-4 verify rows at 17.9 / 34.2 / 26.3 / 24.7 ms: as
    taken, 4 rows look cheaper than 2, so a batch of 2 would draft one token each even when
    none is ever accepted. Settled (engine/core/step_budget.settle_costs), more rows never cost
    less and a never-accepted draft is never worth a row."""
    from engine.core.step_budget import settle_costs
    from engine.spec.cost import SpecCostModel
    from engine.spec.drafting import Drafter

    rows = (1, 2, 3, 4)
    samples = [[0.0179], [0.0342], [0.0263], [0.0247]]
    raw = SpecCostModel(rows, tuple(s[0] for s in samples), (0.0,) * 4)
    settled = SpecCostModel(rows, settle_costs(rows, samples), (0.0,) * 4)
    never = [("suffix", [5], 0.0)] * 2
    assert Drafter(("suffix",), 1, 64, raw).step_k(never) == 1  # the noise's pick
    assert Drafter(("suffix",), 1, 64, settled).step_k(never) == 0
    assert all(a <= b for a, b in zip(settled.target_s, settled.target_s[1:]))


def test_step_costs_are_measured_at_startup(llama_dir, heads) -> None:
    llm = LLM(
        str(llama_dir),
        speculative_model=str(heads["identity"]),
        num_speculative_tokens=3,
        num_kv_blocks=256,
        block_size=16,
        spec_cost_model=True,
        speculative_method="eagle",
    )
    cost = llm.engine.drafter.cost
    assert cost is not None and cost.rows[0] == 1 and len(cost.rows) >= 4
    assert all(t > 0 for t in cost.target_s + cost.draft_s)
    assert llm.engine.info.spec_cost == cost.table()
    out = llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0].token_ids
    assert len(out) == GREEDY.max_tokens


@pytest.mark.parametrize("name", ["random", "eagle3"])
def test_head_on_blocks_is_its_dense_self_rounded(llama_dir, heads, name) -> None:
    """Where the block kernel is built, a head serves its linears (and an EAGLE-3 head its own
    lm_head) as Q8_0 blocks, since a draft step's time is its weights' bytes: each computes what
    the head's own weights do up to that rounding, biases included, on the kernel's few rows and
    on the packed dense copy's many (a prompt's catch-up). The engine-level check that drafts
    stay lossless and kept is test_smollm2's shipped-head test; the greedy tests above run
    with it too."""
    from models.eagle.head import load_eagle_head
    from models.linear.gguf_linear import GGUFWeight, load_q8
    from models.linear.layer import pack_linears

    if load_q8() is None:
        pytest.skip("the block kernel needs AVX2")  # every x86 CPU this project serves has it
    model = LLM(str(llama_dir), num_kv_blocks=64).engine.model
    dtype, cpu = model.embed_tokens.weight.dtype, torch.device("cpu")
    dense = load_eagle_head(str(heads[name]), model, dtype, cpu)
    blocks = load_eagle_head(str(heads[name]), model, dtype, cpu)
    assert blocks.serve_on_blocks(model).startswith("draft head on Q8_0 blocks")
    pack_linears(blocks)  # as the engine's build does (its packed copies serve many rows)
    gen = torch.Generator().manual_seed(0)
    linears = ["fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    for rows in (1, 3, 40):
        for attr in linears + (["lm_head"] if name == "eagle3" else []):
            ours, theirs = getattr(blocks, attr), getattr(dense, attr)
            assert isinstance(ours.method, GGUFWeight) and theirs.dense
            x = torch.randn(rows, theirs.in_features, generator=gen).to(dtype)
            want = theirs(x).float()
            err = (ours(x).float() - want).abs().max() / want.abs().max()
            assert err < 0.02, (attr, rows, err.item())
