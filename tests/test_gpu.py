"""CUDA runs of the engine (skipped without a GPU; scripts/gpu_check.sh runs them on a lent GPU
host): the torch backend on the device against the CPU (float32 exactly, bfloat16 and float16
approximately), FlashInfer and xformers against the torch backend, seeded sampling on the
device, suffix speculation through FlashInfer and an EAGLE head (both lossless), CUDA graphs
on and off (identical greedy tokens), and the startup warm-up."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scoring import score_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPTS = [[5, 17, 99, 3, 250, 44, 8], list(range(10, 90))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
has_flashinfer = importlib.util.find_spec("flashinfer") is not None
has_xformers = importlib.util.find_spec("xformers") is not None


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def cpu(llama_dir) -> LLM:
    """The CPU reference, built once: each CPU engine build costs the device check's time
    budget ~6 s of startup measurements (scripts/gpu_step_costs.py)."""
    return LLM(str(llama_dir), num_kv_blocks=64, device="cpu")


def test_cuda_matches_cpu(llama_dir, cpu) -> None:
    gpu = LLM(str(llama_dir), num_kv_blocks=64, device="cuda", dtype="float32")
    assert gpu.engine.block_size == 16  # the CUDA default
    assert tokens(gpu, PROMPTS) == tokens(cpu, PROMPTS)
    for p in PROMPTS:
        a, b = score_prompt(cpu.engine, p), score_prompt(gpu.engine, p).cpu()
        assert (a - b).abs().max() < 1e-3 * a.abs().max()


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.05), ("float16", 0.01)])
def test_torch_backend_low_precision_decode_on_cuda(llama_dir, cpu, dtype, tol) -> None:
    """The GPU fallback path in bf16/fp16: prefill and batched decode (range and gather paths)
    finish, and scores stay within `tol` of float32 on the CPU."""
    gpu = LLM(
        str(llama_dir), num_kv_blocks=64, device="cuda", dtype=dtype, attention_backend="torch"
    )
    assert gpu.engine.info.dtype == dtype
    for p in PROMPTS:
        a, b = score_prompt(cpu.engine, p), score_prompt(gpu.engine, p).float().cpu()
        assert (a - b).abs().max() < tol * a.abs().max()
    out = gpu.generate(PROMPTS * 4, GREEDY)
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    gpu_host = LLM(
        str(llama_dir),
        num_kv_blocks=16,
        device="cuda",
        dtype=dtype,
        attention_backend="torch",
        host_bytes="64MiB",
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = gpu_host.generate(PROMPTS * 4, params)
    again = gpu_host.generate([PROMPTS[1]], params)[0]  # from the host tier
    assert again.outputs[0].token_ids == first[1].outputs[0].token_ids


def test_auto_dtype_follows_compute_capability(llama_dir) -> None:
    gpu = LLM(str(llama_dir), num_kv_blocks=16, device="cuda")
    want = "bfloat16" if torch.cuda.get_device_capability() >= (8, 0) else "float16"
    assert gpu.engine.info.dtype == want


def test_seeded_sampling_on_cuda(llama_dir) -> None:
    """Seeded requests draw from generators on the device (a CPU generator raised here and
    killed the engine thread): reproducible, and the engine keeps serving."""
    llm = LLM(str(llama_dir), num_kv_blocks=64, device="cuda")
    seeded = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True
    )
    alone = tokens(llm, [PROMPTS[0]], seeded)
    mixed = llm.generate(PROMPTS + [PROMPTS[0]], [GREEDY, GREEDY, seeded])
    assert [o.outputs[0].finish_reason for o in mixed] == ["length"] * 3
    assert tokens(llm, [PROMPTS[0]], seeded) == alone


def test_eagle_head_is_lossless_on_cuda(llama_dir, tmp_path) -> None:
    """An EAGLE head's drafts on the device (its layer, the target's hidden states, the tree of
    one chain verified in one step): the greedy tokens of speculation off."""
    from tests.test_speculative import PIN_K, write_eagle1

    head = write_eagle1(tmp_path / "head", identity=False)
    kw = dict(num_kv_blocks=64, device="cuda", dtype="float32")
    want = tokens(LLM(str(llama_dir), num_speculative_tokens=0, **kw), PROMPTS)
    spec = LLM(
        str(llama_dir),
        speculative_model=str(head),
        speculative_method="eagle",
        num_speculative_tokens=3,
        **PIN_K,
        **kw,
    )
    assert tokens(spec, PROMPTS) == want
    assert spec.engine.drafter.stats["eagle"].num_draft_tokens > 0


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory) -> str:
    """The model scripts/gpu_check.sh builds and compiles FlashInfer's kernels for first
    (tests/conftest.py HEAD64_GQA2)."""
    from tests.conftest import HEAD64_GQA2, build_model

    out = tmp_path_factory.mktemp("head64") / "llama"
    return str(build_model("llama", out, **HEAD64_GQA2))


@pytest.mark.skipif(not has_flashinfer, reason="needs flashinfer")
def test_flashinfer_matches_torch_backend(head64_dir) -> None:
    """Chosen automatically on a GPU for a supported geometry (its warm-up passed); same greedy
    tokens and close logits as the reference backend, with decode-only and mixed steps."""
    fast = LLM(head64_dir, num_kv_blocks=64, device="cuda", dtype="bfloat16", enforce_eager=True)
    ref = LLM(
        head64_dir, num_kv_blocks=64, device="cuda", dtype="bfloat16", attention_backend="torch"
    )
    info = fast.engine.info
    assert info.attention_backend == "flashinfer", info.kernel_table
    assert "warm-up failed" not in info.kernel_table
    want, got = tokens(ref, PROMPTS * 3), tokens(fast, PROMPTS * 3)
    agree = sum(a == b for a, b in zip(got, want))
    assert agree >= len(want) - 1  # bf16 kernels may flip a near-tie
    for p in PROMPTS:
        a, b = score_prompt(ref.engine, p).float(), score_prompt(fast.engine, p).float()
        assert (a - b).abs().max() < 0.05 * a.abs().max()


@pytest.mark.skipif(not has_flashinfer, reason="needs flashinfer")
def test_flashinfer_suffix_speculation_is_lossless(head64_dir) -> None:
    """Speculation as the server ships it (suffix drafts, verify steps through FlashInfer's
    prefill): the greedy tokens of speculation off, and the second time a prompt is sent its
    first answer drafts nearly every token."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kw = dict(num_kv_blocks=64, device="cuda", dtype="bfloat16", speculative_method="suffix")
    want = tokens(LLM(head64_dir, num_speculative_tokens=0, **kw), PROMPTS, params)
    on = LLM(head64_dir, num_speculative_tokens=4, **kw)
    assert on.engine.info.attention_backend == "flashinfer", on.engine.info.kernel_table
    assert tokens(on, PROMPTS, params) == want
    assert tokens(on, PROMPTS, params) == want
    assert on.engine.drafter.stats["suffix"].num_accepted_tokens > 48


@pytest.mark.skipif(not has_flashinfer, reason="needs flashinfer")
def test_cuda_graphs_track_eager_steps(head64_dir) -> None:
    """Graphs replay FlashInfer's split-KV decode kernels over padded batches (other GEMM
    shapes), so bf16 results are close, not bit-identical: the chosen tokens' logprobs agree
    within bf16 tolerance while the two runs agree, and greedy tokens agree at nearly every
    position (a near-tie may flip, and the texts part from there)."""
    kw = dict(num_kv_blocks=128, device="cuda", dtype="bfloat16", max_num_seqs=8)
    eager = LLM(head64_dir, enforce_eager=True, **kw)
    graphs = LLM(head64_dir, **kw)
    assert eager.engine.info.cuda_graphs == ()
    assert graphs.engine.info.cuda_graphs == (1, 2, 4, 8)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    prompts = [PROMPTS[0], PROMPTS[1], [3, 1, 4, 1, 5], [9] * 12, [100, 200, 300]]
    agreed = total = 0
    for batch in (prompts[:1], prompts[:3], prompts):  # buckets 1, 4 (padded), 8 (padded)
        for a, b in zip(eager.generate(batch, params), graphs.generate(batch, params)):
            x, y = a.outputs[0], b.outputs[0]
            same = next(
                (i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t),
                len(x.token_ids),
            )
            agreed, total = agreed + same, total + len(x.token_ids)
            for lx, ly in zip(x.logprobs[:same], y.logprobs[:same]):
                assert abs(lx.logprob - ly.logprob) < 0.05 + 0.02 * abs(lx.logprob)
    assert agreed >= 0.9 * total, (agreed, total)


@pytest.mark.skipif(not has_xformers, reason="needs xformers")
def test_xformers_matches_torch_backend(head64_dir) -> None:
    """Forced on pages of 64 tokens (its split-K operator's BLOCK_N); decode rows through the
    paged Triton operator, prefill through SDPA."""
    kw = dict(num_kv_blocks=64, device="cuda", dtype="bfloat16", block_size=64)
    xf = LLM(head64_dir, attention_backend="xformers", **kw)
    ref = LLM(head64_dir, attention_backend="torch", **kw)
    assert xf.engine.info.attention_backend == "xformers", xf.engine.info.kernel_table
    want, got = tokens(ref, PROMPTS * 3), tokens(xf, PROMPTS * 3)
    assert sum(a == b for a, b in zip(got, want)) >= len(want) - 1


def test_warm_up_failure_is_passed_over(head64_dir, monkeypatch) -> None:
    """A backend whose kernels fail at startup is passed over with the reason in the matrix."""
    from engine.attention.flashinfer_backend import FlashInferStep

    def broken(self, *args, **kwargs):
        raise RuntimeError("simulated JIT failure")

    monkeypatch.setattr(FlashInferStep, "forward", broken)
    llm = LLM(head64_dir, num_kv_blocks=32, device="cuda", dtype="bfloat16")
    info = llm.engine.info
    if has_flashinfer:
        assert "simulated JIT failure" in info.kernel_table
    assert info.attention_backend != "flashinfer"
    assert tokens(llm, [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))
