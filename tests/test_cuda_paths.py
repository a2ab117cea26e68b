"""What breaks on a CUDA host, caught on a CPU-only machine: generators on the engine's device,
sampling inside the per-request failure isolation, the CUDA dtype default, weights cast as they
load, the host tier's copies, and the per-step host/device sync budget (under a fake CUDA
device)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import engine.runner.runner_output as runner_output_module
from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.spec.verify import verify

# ---- item 4: seeded generators live on the engine's device --------------------------------------


class _RecordingGenerator:
    """Stands in for torch.Generator: records the device it was made for."""

    made: list[str] = []

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        _RecordingGenerator.made.append(str(self.device))

    def manual_seed(self, seed: int) -> _RecordingGenerator:
        return self


def test_seeded_request_generator_is_on_the_engine_device(llama_dir, monkeypatch) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=16)
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "device", torch.device("cuda"))  # as on a GPU host
    _RecordingGenerator.made.clear()
    monkeypatch.setattr(torch, "Generator", _RecordingGenerator)
    engine.add_request("seeded", [5, 6, 7], SamplingParams(temperature=1.0, seed=7))
    monkeypatch.undo()
    assert _RecordingGenerator.made == ["cuda"]
    engine.abort_request("seeded")


class _GeneratorDraws(TorchFunctionMode):
    """Records, for every random draw that takes a `generator`, the device the draw lands on:
    an explicit `device=` or the tensor it fills/reads. A draw with neither lands on the default
    device (the CPU), which is wrong for a CUDA generator."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, torch.device, torch.device | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        gen = kwargs.get("generator")
        if gen is not None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            target = kwargs.get("device") or (tensors[0].device if tensors else None)
            self.draws.append((getattr(func, "__name__", str(func)), gen.device, target))
        return func(*args, **kwargs)


def test_every_seeded_draw_lands_on_its_generators_device() -> None:
    """Rejection sampling (speculation) and the sampler draw with per-request generators; each
    draw must be placed on the generator's device explicitly or by the tensor it uses."""
    from engine.runner.sampler import sample

    vocab = 32
    params = SamplingParams(temperature=0.9, seed=11, max_tokens=8)
    r = Request("r", [1, 2, 3], params, frozenset(), 64)
    r.spec_token_ids = [4, 5, 6]
    r.spec_probs = torch.softmax(torch.randn(3, vocab), -1)
    logits = torch.randn(4, vocab)
    with _GeneratorDraws() as mode:
        verify(logits, [r])
        sample(torch.randn(1, vocab), [r])
    assert mode.draws, "no seeded draw was seen"
    bad = [(f, g, t) for f, g, t in mode.draws if t is None or t != g]
    assert not bad, f"draws not placed on their generator's device: {bad}"


# ---- item 4: a sampling failure fails its request, never the engine thread ----------------------


def test_sampling_failure_fails_only_its_request(llama_dir, monkeypatch) -> None:
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    params.append(SamplingParams(temperature=1.0, seed=13, max_tokens=6, ignore_eos=True))
    prompts = [[5, 17, 99], [8, 9, 10, 11], [40, 41]]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params[:2])]
    real = runner_output_module.sample

    def flaky(logits, requests):
        if any(r.sampling_params.seed == 13 for r in requests):
            raise RuntimeError("Expected a 'cuda' device type for generator")  # as on CUDA
        return real(logits, requests)

    monkeypatch.setattr(runner_output_module, "sample", flaky)
    out = llm.generate(prompts, params)  # raised out of step() before
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length", "error"]
    assert [o.outputs[0].token_ids for o in out[:2]] == want
    assert not llm.engine.has_unfinished()


# ---- item 6: the CUDA dtype default follows the compute capability ----------------------------


@pytest.mark.parametrize(
    "capability,want",
    [
        ((7, 0), torch.float16),
        ((7, 5), torch.float16),
        ((8, 0), torch.bfloat16),
        ((9, 0), torch.bfloat16),
    ],
)
def test_cuda_auto_dtype_is_fp16_below_sm80(monkeypatch, capability, want) -> None:
    from engine.config import EngineConfig

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert EngineConfig(device="cuda").resolved_dtype() == want
    assert EngineConfig(device="cpu").resolved_dtype() == torch.float32
    assert EngineConfig(device="cuda", dtype="bfloat16").resolved_dtype() == torch.bfloat16


# ---- item 9: weights cast as they load; the host tier's one copy; config.toml found -------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_arrive_in_the_target_dtype(llama_dir, monkeypatch, dtype) -> None:
    """The model is allocated once in the target dtype, and each checkpoint tensor reaches
    `load_weights` already cast: no float32 copy of the whole model exists on the host."""
    from models.llama import LlamaForCausalLM
    from models.loader import load_model

    seen: list[tuple[str, torch.dtype, torch.dtype]] = []
    real = LlamaForCausalLM.load_weights

    def spy(self, weights):
        param_dtype = next(self.parameters()).dtype

        def watch():
            for name, t in weights:
                seen.append((name, t.dtype, param_dtype))
                yield name, t

        return real(self, watch())

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", spy)
    model, _ = load_model(str(llama_dir), dtype, "cpu")
    assert seen and all(t == dtype and p == dtype for _, t, p in seen), seen[:3]
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not any(p.is_meta for p in model.parameters())


def test_host_tier_moves_each_block_in_one_copy() -> None:
    """Save gathers on the device and copies runs of slots straight into the storage; load
    copies runs of slots straight out of it. No `index_select` of the host storage (a pageable
    temporary the DMA would be staged through) and no `index_copy_` into it (a second copy)."""
    from engine.kv.host import HostTier

    torch.manual_seed(0)
    caches = [torch.randn(2, 2, 16, 4, 8), torch.randn(2, 1, 16, 4, 8)]  # torch layout
    tier = HostTier(caches, 2, 10 * 2 * 3 * 4 * 8 * 4)
    assert tier.num_blocks == 10
    storage_ptrs = {s.untyped_storage().data_ptr() for s in tier.storage}

    class Trace(TorchFunctionMode):
        calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            on_storage = any(
                isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in storage_ptrs
                for a in args[:1]
            )
            if on_storage and name in ("index_select", "index_copy_"):
                Trace.calls.append(name)
            to_cpu = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *kwargs.values()))
            if to_cpu and not on_storage:  # KV brought to a pageable host temporary
                Trace.calls.append("to(cpu)")
            return func(*args, **kwargs)

    blocks = [3, 7, 8, 1, 12]
    want = [c.select(2, b).clone() for b in blocks for c in caches]
    hashes = [bytes([b]) for b in blocks]
    with Trace():
        assert tier.save(list(zip(hashes, blocks))) == 5
        for c in caches:
            c.zero_()
        tier.load(hashes, [0, 2, 4, 6, 9])
    assert Trace.calls == [], Trace.calls
    got = [c.select(2, b) for b in [0, 2, 4, 6, 9] for c in caches]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_config_toml_found_outside_the_checkout(tmp_path, monkeypatch) -> None:
    """An installed kvserve has no config.toml beside its package: KVSERVE_CONFIG names it (the
    image sets it), and a named file that is missing is an error, not silent defaults."""
    from server.config import load_config

    toml = tmp_path / "config.toml"
    toml.write_text("[server]\nport = 8123\n[engine]\nmax_num_seqs = 5\n")
    cfg = load_config([], env={"KVSERVE_CONFIG": str(toml)})
    assert (cfg.server.port, cfg.engine.max_num_seqs) == (8123, 5)
    with pytest.raises(SystemExit, match="not found"):
        load_config([], env={"KVSERVE_CONFIG": str(tmp_path / "missing.toml")})
