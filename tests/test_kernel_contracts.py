"""The GPU kernel backends against the real libraries' signatures and documented tensor
contracts, on a CPU: FlashInfer's wrappers are replaced by tests/flashinfer_fake.py (bound to
flashinfer-python's own signatures, answering with a reference computation); xformers' paged
masks and its Triton split-K operator's `not_supported_reasons` are the real ones.

Also here: the startup warm-up (a backend whose kernels fail is passed over, with the reason in
the matrix), the host/device sync budget of a decode step on the CUDA code path, and the
FlashInfer resources (one zeroed workspace, one wrapper per geometry).
"""

from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import engine.build.pool as kv_phase
from engine import LLM, SamplingParams
from engine.attention import DeviceFacts, select_backend
from engine.attention.base import StepMetadata
from engine.attention.flashinfer_backend import WORKSPACE_BYTES, FlashInferBackend
from engine.attention.matrix import kernel_note
from engine.attention.torch_backend import TorchBackend
from models.spec import ModelSpec, uniform_layers
from tests import flashinfer_fake
from tests.flashinfer_fake import Calls

pytestmark = pytest.mark.isa  # run again under the restricted ISA (scripts/test.sh)

SM90 = DeviceFacts("cuda", "H100", (9, 0), True, frozenset({"flashinfer", "xformers"}))
needs_real_flashinfer = pytest.mark.skipif(
    flashinfer_fake.real_flashinfer is None, reason="flashinfer-python does not import here"
)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    flashinfer_fake.install(monkeypatch)
    return Calls


def two_geometry_spec(window: int | None = 24) -> ModelSpec:
    layers = uniform_layers(3, 8, 2, 64, 128)
    layers = (layers[0], replace(layers[1], num_heads=4, num_kv_heads=1), layers[2])
    return ModelSpec("LlamaForCausalLM", 128, 512, layers, sliding_window=window)


def torch_layout(fi_cache: torch.Tensor) -> torch.Tensor:
    """[blocks, 2, bs, kvh, d] (FlashInfer) -> [2, kvh, blocks, bs, d] (torch backend)."""
    return fi_cache.permute(1, 3, 0, 2, 4).contiguous()


def step_meta(tables: list[list[int]], bs: int, items: list[tuple[int, int, int]]) -> StepMetadata:
    """One step's metadata for (sequence, first position, number of tokens) items over the
    given block tables."""
    qs, ql, cl, sl, tb, slots, row = [], [], [], [], [], [], 0
    for seq, start, n in items:
        qs.append(row), ql.append(n), cl.append(start), sl.append(start + n)
        tb.append(tables[seq])
        slots += [tables[seq][p // bs] * bs + p % bs for p in range(start, start + n)]
        row += n
    return StepMetadata(qs, ql, cl, sl, tb, torch.tensor(slots))


def steps(bs: int) -> list[StepMetadata]:
    """A prefill step (three sequences, no context), a mixed step (a chunk with context, two
    decodes) and two decode-only steps; block tables shuffled."""
    tables = [[7, 3, 11, 0], [5, 9, 1, 14], [2, 13, 6, 10]]

    def meta(items: list[tuple[int, int, int]]) -> StepMetadata:
        return step_meta(tables, bs, items)

    return [
        meta([(0, 0, 9), (1, 0, 17), (2, 0, 5)]),
        meta([(2, 5, 11), (0, 9, 1), (1, 17, 1)]),
        meta([(0, 10, 1), (1, 18, 1), (2, 16, 1)]),
        meta([(0, 11, 1), (1, 19, 1), (2, 17, 1)]),
    ]


@needs_real_flashinfer
def test_flashinfer_backend_matches_torch_backend_through_the_real_signatures(
    fake_flashinfer,
) -> None:
    """Every wrapper, plan and run call binds to flashinfer-python's signatures and meets the
    documented contract (int32 CSR on the host, last_page_len in 1..page_size, 5-D NHD cache,
    causal bottom-right, window_left); the attention computed from the page tables we pass
    equals the reference backend's, for two layer geometries and a sliding window."""
    torch.manual_seed(0)
    spec, bs, num_blocks = two_geometry_spec(), 8, 16
    fi_caches = [
        torch.zeros(FlashInferBackend.kv_cache_shape(num_blocks, bs, h, d))
        for h, d in spec.kv_groups
    ]
    ref_caches = [torch_layout(c) for c in fi_caches]
    fi = FlashInferBackend(spec, fi_caches, bs)
    ref = TorchBackend(spec, ref_caches, bs)
    ref.decode_op = None  # both in PyTorch ops
    for meta in steps(bs):
        fi_step, ref_step = fi.plan(meta), ref.plan(meta)
        n = meta.slot_mapping.numel()
        for layer, lay in enumerate(spec.layers):
            q = torch.randn(n, lay.num_heads, lay.head_dim)
            k, v = torch.randn(2, n, lay.num_kv_heads, lay.head_dim)
            got = fi_step.forward(layer, q, k, v)
            want = ref_step.forward(layer, q, k, v)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for fi_cache, ref_cache in zip(fi_caches, ref_caches):  # the slot writes agree too
        torch.testing.assert_close(torch_layout(fi_cache), ref_cache)
    # one wrapper per (decode|prefill, geometry), kept across steps, all on one zeroed workspace
    kinds = Counter((type(w).__name__, w.workspace.data_ptr()) for w in Calls.wrappers)
    assert len(Calls.wrappers) == 4 and all(n == 2 for n in kinds.values()), kinds
    assert {w.workspace.data_ptr() for w in Calls.wrappers} == {fi.workspace.data_ptr()}
    assert fi.workspace.numel() == WORKSPACE_BYTES and fi.workspace.dtype == torch.uint8
    # each step planned each geometry once (not once per layer)
    assert len(Calls.plans) == len(steps(bs)) * 2
    windows = {p["window_left"] for p in Calls.plans}
    assert windows == {spec.sliding_window - 1}


@needs_real_flashinfer
def test_page_tables_are_built_on_the_host_whatever_the_cache_device(
    fake_flashinfer, monkeypatch
) -> None:
    """With the KV pool on another device (meta stands in for CUDA), indptr, indices and
    last_page_len still reach plan() as host tensors: plan reads them on the host, so device
    ones would be copied back (a sync per tensor per plan)."""
    monkeypatch.setattr(flashinfer_fake, "reference_attention", lambda q, cache, p: q.clone())
    spec, bs = two_geometry_spec(), 8
    meta_dev = torch.device("meta")
    caches = [
        torch.empty(FlashInferBackend.kv_cache_shape(16, bs, h, d), device=meta_dev)
        for h, d in spec.kv_groups
    ]
    backend = FlashInferBackend(
        spec, caches, bs, workspace=torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=meta_dev)
    )
    for meta in steps(bs):
        meta.slot_mapping = meta.slot_mapping.to(meta_dev)
        step = backend.plan(meta)
        n = meta.slot_mapping.numel()
        for layer, lay in enumerate(spec.layers):
            q = torch.empty(n, lay.num_heads, lay.head_dim, device=meta_dev)
            kv = torch.empty(n, lay.num_kv_heads, lay.head_dim, device=meta_dev)
            step.forward(layer, q, kv, kv)
    assert len(Calls.plans) == 8  # the contract checks ran in every plan


def test_flashinfer_workspace_is_zeroed_and_allocated_before_the_pool(monkeypatch) -> None:
    """FlashInfer's docs: the float workspace "must be initialized to 0 for its first use". The
    builder allocates it before it sizes the pool from the memory left."""
    ws = FlashInferBackend.allocate_workspace(torch.device("cpu"))
    assert ws.numel() == WORKSPACE_BYTES and not bool(ws.any())
    order: list[str] = []
    monkeypatch.setattr(
        FlashInferBackend,
        "allocate_workspace",
        classmethod(lambda cls, d: order.append("ws") or torch.zeros(16, dtype=torch.uint8)),
    )
    real = kv_phase.num_blocks_for
    monkeypatch.setattr(kv_phase, "num_blocks_for", lambda *a: order.append("pool") or real(*a))
    monkeypatch.setattr(kv_phase, "warm_up", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    monkeypatch.setattr(kv_phase.DeviceFacts, "detect", staticmethod(lambda device: SM90))
    with pytest.raises(ValueError, match="forced"):
        kv_phase.choose_and_warm_up(
            kv_phase.EngineConfig(attention_backend="flashinfer", num_kv_blocks=8),
            None,
            two_geometry_spec(),
            SM90,
            torch.bfloat16,
            torch.device("cpu"),
            16,
            1024,
            64,
            torch.bfloat16,
        )
    assert order == ["ws", "pool"]


@needs_real_flashinfer
def test_draft_steps_plan_only_the_geometries_they_run(fake_flashinfer) -> None:
    spec, bs = two_geometry_spec(None), 8
    caches = [
        torch.zeros(FlashInferBackend.kv_cache_shape(16, bs, h, d)) for h, d in spec.kv_groups
    ]
    backend = FlashInferBackend(spec, caches, bs)
    meta = steps(bs)[2]
    step = backend.plan(meta)
    assert Calls.plans == []  # nothing planned until a layer runs
    lay = spec.layers[1]
    q = torch.randn(3, lay.num_heads, lay.head_dim)
    step.forward(1, q, *torch.randn(2, 3, lay.num_kv_heads, lay.head_dim))
    step.forward(1, q, None, None)
    assert [(p["num_qo_heads"], p["num_kv_heads"]) for p in Calls.plans] == [(4, 1)]


# ---- the warm-up decides ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory) -> str:
    """A tiny Llama with head_dim 64 (FlashInfer's smallest head size), GQA 4."""
    from tests.conftest import build_model

    out = tmp_path_factory.mktemp("head64") / "llama"
    dims = dict(hidden_size=256, intermediate_size=512, num_key_value_heads=1)
    return str(build_model("llama", out, **dims))


def cuda_facts(monkeypatch) -> None:
    """The builder sees an sm90 GPU with FlashInfer; tensors stay on the CPU."""
    monkeypatch.setattr(kv_phase.DeviceFacts, "detect", staticmethod(lambda device: SM90))


@needs_real_flashinfer
def test_warm_up_runs_every_geometry_before_serving(head64_dir, fake_flashinfer, monkeypatch):
    cuda_facts(monkeypatch)
    llm = LLM(head64_dir, num_kv_blocks=32, dtype="bfloat16", block_size=16)
    assert llm.engine.info.attention_backend == "flashinfer"
    warm_runs = len(Calls.runs)
    assert warm_runs > 0 and Calls.plans, "no warm-up ran through the kernels"
    kinds = {type(p["wrapper"]).__name__ for p in Calls.plans}
    assert kinds == {"BatchPrefillWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper"}
    out = llm.generate([[5, 17, 99, 3], [250, 44, 8]], SamplingParams(temperature=0, max_tokens=4))
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]


@needs_real_flashinfer
def test_backend_that_fails_warm_up_is_passed_over_loudly(
    head64_dir, fake_flashinfer, monkeypatch, caplog
) -> None:
    cuda_facts(monkeypatch)

    def broken(self, *args, **kwargs):
        raise RuntimeError(
            "Could not find nvcc and default cuda_home='/usr/local/cuda' doesn't exist"
        )

    monkeypatch.setattr(flashinfer_fake.BatchPrefillWithPagedKVCacheWrapper, "plan", broken)
    llm = LLM(head64_dir, num_kv_blocks=32, dtype="bfloat16", block_size=16)
    info = llm.engine.info
    assert info.attention_backend == "torch"
    assert "warm-up failed: RuntimeError: Could not find nvcc" in info.kernel_table
    assert "flashinfer passed over" in info.kernel_table
    assert "warm-up failed" in caplog.text and "slow general path" in caplog.text
    with pytest.raises(ValueError, match="require-fast-kernels"):
        LLM(head64_dir, num_kv_blocks=32, dtype="bfloat16", require_fast_kernels=True)
    with pytest.raises(ValueError, match="forced.*Could not find nvcc"):
        LLM(head64_dir, num_kv_blocks=32, dtype="bfloat16", attention_backend="flashinfer")


def test_jit_only_flashinfer_without_nvcc_is_a_matrix_reason(monkeypatch) -> None:
    """flashinfer-python is JIT-only: importable is not enough. Without nvcc and without a
    matching flashinfer-jit-cache the matrix says so, and --require-fast-kernels refuses."""
    import engine.attention.matrix as matrix

    monkeypatch.setattr(matrix, "find_nvcc", lambda: None)
    monkeypatch.setattr(
        matrix, "_version", lambda dist: "0.7.2.post1" if dist == "flashinfer-python" else None
    )
    note = kernel_note("flashinfer")
    assert note is not None and "JIT-only" in note and "nvcc" in note
    facts = replace(SM90, kernel_notes={"flashinfer": note})
    choice = select_backend(two_geometry_spec(), facts, torch.bfloat16, 16)
    assert choice.backend.name != "flashinfer" and "JIT-only" in choice.table
    with pytest.raises(ValueError, match="require-fast-kernels"):
        select_backend(two_geometry_spec(), facts, torch.bfloat16, 16, require_fast_kernels=True)
    monkeypatch.setattr(matrix, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    assert kernel_note("flashinfer") is None


# ---- host/device syncs per decode step ----------------------------------------------------------


class SyncCounter(TorchFunctionMode):
    """Counts what would be a host/device synchronisation or transfer on a CUDA device: reads
    (`.item`, `.tolist`, `__bool__`, `__int__`, `__float__`, `.cpu`, `.numpy`) and uploads
    (`.to(device)`, `torch.tensor(..., device=...)`). Calls made by the FlashInfer stand-in
    itself are not ours and are not counted."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        kind = None
        if name in self.READS:
            kind = name
        elif name in ("to", "cuda") and (
            "device" in kwargs or any(isinstance(a, str | torch.device) for a in args[1:])
        ):
            kind = "to(device)"
        elif name == "tensor" and kwargs.get("device") is not None:
            kind = "tensor(device=)"
        if kind is not None:
            frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
            where = f"{frames[-1].filename.rsplit('/', 2)[-2:]}:{frames[-1].lineno}"
            if "flashinfer_fake" not in where:
                self.events.append((kind, where))
        return func(*args, **kwargs)


@needs_real_flashinfer
def test_greedy_decode_step_sync_budget(head64_dir, fake_flashinfer, monkeypatch) -> None:
    """A greedy decode step of 4 requests on the CUDA code path (FlashInfer backend, fake sm90
    device) makes at most 3 host/device transfers: one upload (token ids, positions and slots
    in one tensor) and two reads (the non-finite check, the sampled ids). FlashInfer's plan
    uploads its page tables itself (from host tensors: no read back)."""
    cuda_facts(monkeypatch)
    llm = LLM(head64_dir, num_kv_blocks=32, dtype="bfloat16", block_size=16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i in range(4):
        engine.add_request(str(i), [5, 6, 7, 8 + i], params)
    engine.step()  # prefill
    engine.step()
    with SyncCounter() as counter:
        outputs = engine.step()
    assert len(outputs) == 4
    reads = [e for e in counter.events if e[0] not in ("to(device)", "tensor(device=)")]
    assert len(counter.events) <= 3 and len(reads) <= 2, counter.events
    engine.abort_all()


# ---- xformers ------------------------------------------------------------------------------------

try:
    import xformers.ops.fmha as real_fmha
except Exception:  # noqa: BLE001 - not installed, or fails to import
    real_fmha = None
needs_xformers = pytest.mark.skipif(real_fmha is None, reason="xformers does not import here")


def _xformers_reference(query, key, value, attn_bias, scale):
    """What the paged operator computes, from the real mask's own `materialize` (block-table
    padding replaced by distinct unused pages: materialize copies page by page, so a padded
    duplicate would overwrite a real page's mask)."""
    bs = attn_bias.page_size
    table = attn_bias.block_tables.clone()
    lens = attn_bias.k_seqinfo.seqlen_py
    used = {int(b) for row, n in zip(table, lens) for b in row[: -(-n // bs)]}
    spare = iter(b for b in range(key.shape[1] // bs) if b not in used)
    for row, n in zip(table, lens):
        for j in range(-(-n // bs), table.shape[1]):
            row[j] = next(spare)
    starts = attn_bias.q_seqinfo.seqstart_py
    q_lens = [b - a for a, b in zip(starts, starts[1:])]
    bias = type(attn_bias).from_seqlens(q_lens, lens, table, bs, device=query.device)
    n_q, physical = query.shape[1], (int(table.max()) + 1) * bs
    mask = bias.materialize((n_q, table.shape[0] * table.shape[1] * bs))  # [q, physical]
    q = query[0].float()  # [n, G, H, d]
    k, v = key[0, :physical].float(), value[0, :physical].float()  # [keys, G, H, d]
    s = torch.einsum("qghd,kghd->ghqk", q, k) * scale + mask[:, :physical]
    return torch.einsum("ghqk,kghd->qghd", s.softmax(-1), v)[None].to(query.dtype)


@needs_xformers
def test_xformers_backend_against_the_real_paged_mask_and_operator(monkeypatch) -> None:
    """Decode rows reach `memory_efficient_attention_forward` with the real paged causal mask
    and `triton_splitk.FwOp`; the operator's own `not_supported_reasons` for those inputs name
    nothing but the CPU (the shapes, BMGHK GQA layout, page size and mask type all pass); the
    result computed from the mask's own semantics equals the torch backend's. Prefill chunks
    (SDPA) match too."""
    from engine.attention.xformers_backend import XFormersBackend

    calls: list[list[str]] = []
    real_forward = real_fmha.memory_efficient_attention_forward

    def checked(*args, **kwargs):
        import inspect

        bound = inspect.signature(real_forward).bind(*args, **kwargs)
        a = bound.arguments
        op = a["op"]
        assert op is real_fmha.triton_splitk.FwOp
        inputs = real_fmha.common.Inputs(
            query=a["query"],
            key=a["key"],
            value=a["value"],
            attn_bias=a["attn_bias"],
            scale=a["scale"],
        )
        reasons = op.not_supported_reasons(inputs)
        calls.append(reasons)
        assert all("device=cpu" in r or "A100" in r for r in reasons), reasons
        return _xformers_reference(a["query"], a["key"], a["value"], a["attn_bias"], a["scale"])

    monkeypatch.setattr(real_fmha, "memory_efficient_attention_forward", checked)
    torch.manual_seed(0)
    bs, num_blocks = 64, 12
    spec = ModelSpec("LlamaForCausalLM", 128, 512, uniform_layers(2, 8, 2, 64, 128))
    dtype = torch.bfloat16
    xf_caches = [
        torch.zeros(XFormersBackend.kv_cache_shape(num_blocks, bs, h, d), dtype=dtype)
        for h, d in spec.kv_groups
    ]
    ref_caches = [c.permute(0, 3, 1, 2, 4).contiguous() for c in xf_caches]  # torch layout
    xf, ref = XFormersBackend(spec, xf_caches, bs), TorchBackend(spec, ref_caches, bs)
    tables = [[7, 3, 11], [5, 9, 1], [2, 10, 6]]

    def meta(items: list[tuple[int, int, int]]) -> StepMetadata:
        return step_meta(tables, bs, items)

    plan = [
        meta([(0, 0, 70), (1, 0, 130), (2, 0, 5)]),  # prefill: SDPA
        meta([(2, 5, 40), (0, 70, 1), (1, 130, 1)]),  # mixed: a chunk with context + decodes
        meta([(0, 71, 1), (1, 131, 1), (2, 45, 1)]),  # decode: the paged operator
    ]
    for m in plan:
        xf_step, ref_step = xf.plan(m), ref.plan(m)
        n = m.slot_mapping.numel()
        for layer in range(2):
            q = torch.randn(n, 8, 64, dtype=dtype)
            k, v = torch.randn(2, n, 2, 64, dtype=dtype)
            torch.testing.assert_close(
                xf_step.forward(layer, q, k, v).float(),
                ref_step.forward(layer, q, k, v).float(),
                atol=2e-2,
                rtol=2e-2,
            )
    assert len(calls) == 4  # two layers x (mixed, decode) steps went through the operator


def test_xformers_matrix_rows() -> None:
    """xformers serves what FlashInfer does not (head_dim 32, pages of 128) and says why not
    elsewhere."""
    facts = replace(SM90, libraries=frozenset({"xformers"}))
    spec32 = ModelSpec("LlamaForCausalLM", 128, 256, uniform_layers(2, 8, 2, 32, 128))
    assert select_backend(spec32, SM90, torch.bfloat16, 64).backend.name == "xformers"
    assert select_backend(two_geometry_spec(None), SM90, torch.bfloat16, 128).backend.name == (
        "xformers"
    )
    choice = select_backend(spec32, facts, torch.bfloat16, 16)
    assert choice.backend.name == "torch" and "not a multiple of the Triton split-K" in choice.table
    choice = select_backend(two_geometry_spec(24), facts, torch.bfloat16, 64)
    assert "no paged local-attention mask in its kernels" in choice.table
    sm75 = replace(facts, capability=(7, 5))
    assert "< sm80" in select_backend(spec32, sm75, torch.float16, 64).table


# ---- CUDA graphs: the replay plumbing, with the capture simulated --------------------------------


def _simulated_capture(self) -> None:
    """CudaGraphs.capture without CUDA: the same static buffers, graph-mode FlashInfer wrappers
    (bound to the real constructor: use_cuda_graph=True with fixed page-table buffers) and
    padding; "replay" reruns the model on the static buffers."""
    from engine.runner.cuda_graphs import _Graph, pad_metadata

    for size in self.sizes:
        step = self.backend.graph_step(size, size * self.max_pages_per_seq)
        ids = torch.zeros(size, dtype=torch.long)
        pos = torch.zeros(size, dtype=torch.long)
        step.update(
            pad_metadata(
                StepMetadata([], [], [], [], [], pos[:0]), size, self.scratch_block, self.block_size
            )
        )
        with torch.inference_mode():
            out = self.model(ids, pos, step, self.aux_layers)

        class Replay:
            def replay(_, ids=ids, pos=pos, step=step, out=out) -> None:
                with torch.inference_mode():
                    out.copy_(self.model(ids, pos, step, self.aux_layers))

        self.graphs[size] = _Graph(size, step, Replay(), ids, pos, out)


@needs_real_flashinfer
def test_cuda_graph_decode_path_matches_eager(head64_dir, fake_flashinfer, monkeypatch) -> None:
    """Greedy tokens through the graph path (inputs copied into bucket buffers, rows padded
    into the scratch block past the pool, every geometry planned before replay) equal the eager
    path's, for batch sizes that fill a bucket and that need padding; --enforce-eager keeps it
    off."""
    from engine.runner.cuda_graphs import CudaGraphs

    cuda_facts(monkeypatch)
    monkeypatch.setattr(
        kv_phase, "use_cuda_graphs", lambda config, device, cls: not config.enforce_eager
    )
    monkeypatch.setattr(CudaGraphs, "capture", _simulated_capture)
    prompts = [[5, 17, 99, 3], [250, 44, 8], list(range(30, 60)), [7] * 20, [1, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(num_kv_blocks=40, dtype="bfloat16", block_size=16, max_num_seqs=5)
    eager = LLM(head64_dir, enforce_eager=True, **kw)
    assert eager.engine.info.cuda_graphs == ()
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(head64_dir, **kw)
    assert graphed.engine.info.cuda_graphs == (1, 2, 4, 5)
    assert graphed.engine.kv.pool.num_blocks == 40  # the scratch block is not in the pool
    replays = Counter()
    real_run = CudaGraphs.run

    def counting_run(self, input_ids, positions, meta):
        replays[next(s for s in self.sizes if s >= meta.num_seqs)] += 1
        return real_run(self, input_ids, positions, meta)

    monkeypatch.setattr(CudaGraphs, "run", counting_run)
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert replays[5] > 0  # five sequences decoding together
    got3 = [o.outputs[0].token_ids for o in graphed.generate(prompts[:3], params)]
    assert got3 == want[:3] and replays[4] > 0  # three rows padded to the bucket of four
