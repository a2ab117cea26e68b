"""Tensor parallelism on CPU with two ranks (gloo): the plan per layer group, greedy output
identical to one rank (tiny Llama, Qwen2, and an OpenELM-style model whose per-layer heads do
not all divide by 2) through the engine API and HTTP, prefix hits and host-tier reloads under
TP, a killed rank taking the server down, ranks that cannot meet."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import torch
from server_utils import InProcessServer, kvserve_server
from test_geometry import prompts, reference_greedy, write_openelm
from test_speculative import write_eagle3

from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm import LLM
from engine.parallel.collectives import free_port, meet
from engine.parallel.tensor_parallel import refusal
from harness import sse
from models.spec import LayerSpec, ModelSpec, uniform_layers
from models.tp_plan import RankShard, plan_tensor_parallel
from server.__main__ import kernels

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def spec_of(heads: list[tuple[int, int]], inter: int = 128, shared: bool = False) -> ModelSpec:
    layers = tuple(
        LayerSpec(h, kv, 16, inter, kv_group=0 if shared else i) for i, (h, kv) in enumerate(heads)
    )
    return ModelSpec("LlamaForCausalLM", 100, 64, layers)


# ---- the plan (pure) -------------------------------------------------------------------------


def test_plan_per_layer_group() -> None:
    # Laguna-like depth profile: 32 heads early, 64 in the middle, 96 late (8 KV heads)
    laguna = spec_of([(32, 8)] * 2 + [(64, 8)] * 3 + [(96, 8)] * 2)
    for n in (2, 4, 8):
        plan = plan_tensor_parallel(laguna, n)
        assert [(g.first, g.last, g.mode) for g in plan.groups] == [
            (0, 1, "sharded"),
            (2, 4, "sharded"),
            (5, 6, "sharded"),
        ]
    # 16 ranks: 8 KV heads are replicated on pairs of ranks
    assert {g.mode for g in plan_tensor_parallel(laguna, 16).groups} == {"kv replicated"}
    # OpenELM-style: 4/1 replicates its one KV head, 8/2 shards, 6/3 cannot split over 2
    plan = plan_tensor_parallel(spec_of([(4, 1), (8, 2), (6, 3), (6, 3), (10, 5)]), 2)
    whole = "whole, layer by layer over the ranks"
    assert [(g.first, g.last, g.mode) for g in plan.groups] == [
        (0, 0, "kv replicated"),
        (1, 1, "sharded"),
        (2, 3, whole),
        (4, 4, whole),
    ]
    # the layers no split fits move from rank to rank, across groups too
    assert [plan.group_of(i).ranks_of(i) for i in range(5)] == [(0, 1), (0, 1), (0,), (1,), (0,)]
    # SmolLM2's 9/3 heads over 2 ranks: 15 layers each, the KV evenly
    smol = spec_of([(9, 3)] * 30)
    assert "KV bytes/token by rank, all layers: 5760/5760" in plan_tensor_parallel(smol, 2).table(
        smol, 4
    )


def test_shards_cover_every_head_once() -> None:
    spec = spec_of([(4, 1), (8, 2), (6, 3)], inter=96)
    plan = plan_tensor_parallel(spec, 2)
    shards = [RankShard(spec, plan, r) for r in range(2)]
    for i, lay in enumerate(spec.layers):
        d = lay.head_dim
        full = torch.arange(float((lay.num_heads + 2 * lay.num_kv_heads) * d))[:, None]
        name = f"layers.{i}.qkv_proj.weight"
        q_rows = sorted(
            int(v) for s in shards for v in s.cut(name, full)[: s.spec.layers[i].num_heads * d]
        )
        assert q_rows == list(range(lay.num_heads * d))  # each query head on exactly one rank
        o = torch.arange(float(lay.num_heads * d))[None, :]
        cols = sorted(int(v) for s in shards for v in s.cut(f"layers.{i}.o_proj.weight", o)[0])
        assert cols == list(range(lay.num_heads * d))
        down = torch.arange(float(lay.intermediate_size))[None, :]
        cols = sorted(
            int(v) for s in shards for v in s.cut(f"layers.{i}.down_proj.weight", down)[0]
        )
        assert cols == list(range(lay.intermediate_size))
    # the whole-on-one-rank layer: rank 1 has no heads, hence no KV, in layer 2
    assert shards[1].spec.layers[2].num_heads == 0 and shards[1].spec.layers[2].num_kv_heads == 0
    table = plan.table(spec, 4)
    assert "whole, layer by layer" in table and "KV bytes/token by rank 384/0" in table


def test_refused_layouts_and_settings() -> None:
    with pytest.raises(ValueError, match="share KV across layers"):
        plan_tensor_parallel(spec_of([(4, 2), (4, 2)], shared=True), 2)
    assert "calibrates" in refusal(EngineConfig(quantization="int8", tensor_parallel_size=2))
    assert "disk" in refusal(EngineConfig(disk_path="/tmp/x", tensor_parallel_size=2))
    assert refusal(EngineConfig(tensor_parallel_size=2)) is None
    assert plan_tensor_parallel(spec_of([(4, 2)]), 1).groups[0].ranks_of(0) == (0,)
    assert len(uniform_layers(2, 4, 2, 16, 32)) == 2


def test_kernels_command_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_openelm(tmp_path / "openelm")
    assert kernels(["--model", str(tmp_path / "openelm"), "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel: 2 ranks" in out and "whole, layer by layer" in out


@pytest.mark.slow
def test_ranks_that_do_not_meet_fail_with_a_message() -> None:
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="did not meet within 1 s"):
        meet(0, 2, free_port(), torch.device("cpu"), timeout_s=1)
    assert time.monotonic() - t < 10


# ---- two ranks against one -------------------------------------------------------------------


def generate(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(ps, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_one_rank(model_dirs: dict[str, Path], arch: str) -> None:
    ps = prompts()
    options = dict(dtype="float32", num_kv_blocks=64, block_size=4)
    want = generate(LLM(str(model_dirs[arch]), **options), ps)
    two = LLM(str(model_dirs[arch]), tensor_parallel_size=2, **options)
    try:
        assert generate(two, ps[:2]) == want[:2]
        assert generate(two, ps) == want  # batched, with prefix hits on the shared 24 tokens
        assert two.engine.kv.prefix_hits > 0
        assert "tensor parallel: 2 ranks" in two.engine.info.kernel_table
    finally:
        two.engine.shutdown()


@pytest.mark.slow
def test_uneven_heads_and_host_tier_under_tp(tmp_path: Path) -> None:
    """OpenELM-style heads (4/1, 8/2, 6/3 per layer: the last cannot split over 2 ranks) match
    the reference; a 12-block pool pushes earlier prompts' blocks to the host tier, and asking
    again loads them back on both ranks (the same tokens, not recomputed)."""
    layers, w = write_openelm(tmp_path / "openelm")
    ps = prompts()
    want = [reference_greedy(layers, w, p, 12, 10000.0) for p in ps]
    llm = LLM(
        str(tmp_path / "openelm"),
        dtype="float32",
        num_kv_blocks=12,
        block_size=4,
        host_bytes="1MiB",
        tensor_parallel_size=2,
        max_num_seqs=1,
    )
    try:
        table = llm.engine.info.kernel_table
        assert "whole, layer by layer" in table and "kv replicated" in table
        assert [generate(llm, [p])[0] for p in ps] == want
        host = llm.engine.host
        assert host is not None and host.saved_blocks > 0
        assert generate(llm, [ps[0]]) == want[:1]  # its prefix comes back from the host tier
        assert host.loaded_blocks > 0
        assert llm.engine.kv.pool.num_free_blocks == 12
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_http_and_a_killed_rank(tmp_path: Path) -> None:
    """Through HTTP with two ranks: the same greedy completion as one rank; then rank 1 is
    killed: /health turns 503 and the server exits non-zero on its own (no hang)."""
    write_openelm(tmp_path / "openelm")
    model = str(tmp_path / "openelm")
    ps = prompts()[:3]
    one = LLM(model, dtype="float32", num_kv_blocks=64, block_size=4)
    want = [r.outputs[0].text for r in one.generate(ps, GREEDY)]
    with kvserve_server(
        model, dtype="float32", num_kv_blocks=64, block_size=4, tensor_parallel_size=2
    ) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
        name = client.models.list().data[0].id
        for p, text in zip(ps, want, strict=True):
            r = client.completions.create(
                model=name, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
            )
            assert r.choices[0].text == text
        workers = [
            c
            for c in psutil.Process(server.proc.pid).children()
            if "engine.parallel.worker" in " ".join(c.cmdline())
        ]
        assert len(workers) == 1
        # one poll before the loss, so the set below is never empty (a 5xx there fails too)
        statuses = {httpx.get(server.base + "/health", timeout=10).status_code}
        workers[0].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.add(httpx.get(server.base + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert server.proc.poll() not in (None, 0), "the server outlived its rank"
        # between the loss and the exit /health says 503 (the in-process test below holds
        # that state open); the exit can come before a poll sees it
        assert 200 in statuses and statuses <= {200, 503}, statuses
        assert "tensor-parallel rank 1 exited" in server.log()


@pytest.mark.slow
def test_a_killed_rank_ends_streams_and_health_says_503(tmp_path: Path) -> None:
    """The same loss in an in-process server (its fatal handler records instead of exiting):
    a stream in flight ends with an error event, /health is 503, new requests get 503."""
    write_openelm(tmp_path / "openelm")
    live = InProcessServer(
        tmp_path / "openelm", engine={"tensor_parallel_size": 2, "num_kv_blocks": 64}
    )
    try:
        events: list[str] = []
        body = {"prompt": [5, 6], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", live.base + "/v1/completions", json=body, timeout=60) as r:
            for payload in sse.data(r):
                events.append(payload)
                if len(events) == 3:
                    live.core.tp.procs[0].kill()
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert httpx.get(live.base + "/health", timeout=10).status_code == 503
        assert len(live.fatal) == 1 and "rank 1" in str(live.fatal[0])
        late = httpx.post(live.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert late.status_code == 503
    finally:
        live.stop()
        live.engine.shutdown()


def test_ggml_blocks_are_cut_like_their_dense_weight() -> None:
    """A GGUF weight's blocks cut for a rank (rows for q/k/v, gate/up and the vocabulary part;
    columns, on block boundaries, for o and down) dequantize to the cut of the dense weight."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from models.linear.gguf_linear import BLOCK_BYTES

    spec = spec_of([(4, 2), (4, 2)], inter=128)
    kind = GGMLQuantizationType.Q8_0
    for rank in range(2):
        shard = RankShard(spec, plan_tensor_parallel(spec, 2), rank)
        for name, shape in (
            ("layers.0.qkv_proj.weight", (128, 64)),
            ("layers.1.down_proj.weight", (64, 128)),
            ("layers.0.o_proj.weight", (64, 64)),
            ("lm_head.weight", (100, 64)),
        ):
            dense = torch.randn(shape).numpy()
            blocks = torch.from_numpy(quantize(dense, kind))
            cut = shard.cut_blocks(name, blocks, BLOCK_BYTES["Q8_0"])
            got = dequantize(cut.numpy(), kind)
            want = shard.cut(name, torch.from_numpy(dequantize(blocks.numpy(), kind))).numpy()
            assert got.shape == want.shape and (got == want).all(), name
    parts = [RankShard(spec, plan_tensor_parallel(spec, 2), r).vocab_part for r in range(2)]
    assert parts == [(0, 50), (50, 100)]


@pytest.mark.slow
def test_an_eagle3_head_drafts_on_rank_0(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Speculation stays rank 0's: an EAGLE-3 head (fed by the target's auxiliary hidden
    states, its KV group in rank 0's pool only) drafts, every rank verifies; greedy output
    identical to one rank's with the same head."""
    head = write_eagle3(tmp_path / "eagle3")
    options = dict(
        dtype="float32",
        num_kv_blocks=128,
        block_size=4,
        speculative_model=str(head),
        speculative_method="eagle",
        num_speculative_tokens=3,
        spec_cost_model=False,
    )
    ps = prompts()
    want = generate(LLM(str(model_dirs["llama"]), **options), ps)
    two = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, **options)
    try:
        assert two.engine.info.draft_layout == "eagle3"
        assert generate(two, ps) == want
        assert two.engine.stats.generation_tokens == len(ps) * GREEDY.max_tokens
        assert two.engine.snapshot().spec.by_source["eagle"][0] > 0  # the head did draft
    finally:
        two.engine.shutdown()


@pytest.mark.slow
def test_engines_one_after_another_and_side_by_side(model_dirs: dict[str, Path]) -> None:
    """An engine owns its ranks and its process group: one dropped without a shutdown takes
    its workers with it when collected, the next forms a group of its own, and two serve side
    by side in one process (torch's default group allowed one at a time)."""
    import gc

    ps = prompts()[:2]
    options = dict(dtype="float32", num_kv_blocks=64, block_size=4)
    llama, qwen2 = str(model_dirs["llama"]), str(model_dirs["qwen2"])
    want = {path: generate(LLM(path, **options), ps) for path in (llama, qwen2)}
    first = LLM(llama, tensor_parallel_size=2, **options)
    assert generate(first, ps) == want[llama]
    workers = list(first.engine.tp.procs)
    del first
    gc.collect()
    for proc in workers:
        assert proc.wait(timeout=30) is not None  # its ranks ended with it
    with (
        LLM(qwen2, tensor_parallel_size=2, **options) as a,
        LLM(llama, tensor_parallel_size=2, **options) as b,
    ):
        assert generate(a, ps) == want[qwen2]
        assert generate(b, ps) == want[llama]
        assert generate(a, ps) == want[qwen2]  # interleaved, each on its own group
        workers = [*a.engine.tp.procs, *b.engine.tp.procs]
    for proc in workers:  # the context managers shut both down
        assert proc.poll() is not None
