"""LoRA adapters in the engine: each adapter's float32 greedy output and prompt logprobs equal
PEFT's merged model in transformers; a batch mixing the base model and two adapters equals each
alone; prefix hits within one adapter and none across; at most max_loras adapters run at once;
bad adapter files are clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from models.lora import LoRAError
from tests.lora_utils import make_adapter, merged_model, reference_greedy
from tests.test_drafting import PIN_K

PROMPTS = [[5, 17, 99, 3, 44, 8, 120, 7, 61, 33, 11, 250, 18], list(range(3, 40)), [40, 41, 42]]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": make_adapter(llama_dir, root / "a", seed=1),
        # attention only, another rank and rsLoRA scaling
        "b": make_adapter(
            llama_dir,
            root / "b",
            seed=2,
            r=8,
            alpha=4,
            targets=["q_proj", "v_proj", "o_proj"],
            use_rslora=True,
        ),
    }


def lora_llm(llama_dir, lora_modules: list[str], **extra) -> LLM:
    """The float32 engine these tests serve adapters on: 64 blocks of 4 unless `extra` says."""
    options = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 4} | extra
    return LLM(str(llama_dir), lora_modules=lora_modules, **options)


@pytest.fixture(scope="module")
def llm(llama_dir, adapters) -> LLM:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return lora_llm(llama_dir, modules, max_num_batched_tokens=32)


def greedy(llm: LLM, lora: str | None, n: int = 8, **extra) -> SamplingParams:
    ref = llm.engine.loras.refs[lora] if lora else None
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, lora=ref, **extra)


@pytest.mark.parametrize("name", [None, "a", "b"])
def test_each_adapter_equals_peft_merged(llm, llama_dir, adapters, name) -> None:
    model = merged_model(llama_dir, adapters[name] if name else None)
    params = greedy(llm, name, prompt_logprobs=0)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        tokens, logprobs = reference_greedy(model, prompt, 8)
        assert out.outputs[0].token_ids == tokens
        want = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = [e.logprob for e in out.outputs[0].prompt_logprobs[1:]]
        assert got == pytest.approx(want.tolist(), abs=1e-4)


def test_adapters_change_the_output(llm) -> None:
    outs = {
        name: llm.generate([PROMPTS[1]], greedy(llm, name, 12))[0].outputs[0].token_ids
        for name in (None, "a", "b")
    }
    assert len({tuple(v) for v in outs.values()}) == 3, outs


def test_a_mixed_batch_equals_each_alone(llm) -> None:
    names = [None, "a", "b", "a", None, "b"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    alone = [
        llm.generate([p], greedy(llm, n))[0].outputs[0].token_ids
        for p, n in zip(prompts, names, strict=True)
    ]
    llm.engine.reset_prefix_cache()
    mixed = llm.generate(prompts, [greedy(llm, n) for n in names])
    assert [o.outputs[0].token_ids for o in mixed] == alone
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.num_blocks


def test_prefix_hits_within_an_adapter_and_none_across(llm) -> None:
    prompt = list(range(60, 100))
    llm.engine.reset_prefix_cache()
    first = llm.generate([prompt], greedy(llm, "a", 2))[0]
    again = llm.generate([prompt], greedy(llm, "a", 2))[0]
    other = llm.generate([prompt], greedy(llm, "b", 2))[0]
    base = llm.generate([prompt], greedy(llm, None, 2))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_at_most_max_loras_adapters_run_at_once(llama_dir, adapters) -> None:
    modules = [f"{name}={path}" for name, path in adapters.items()]
    llm = lora_llm(llama_dir, modules, max_loras=1)
    engine = llm.engine
    for i, name in enumerate(["a", "b", "a", "b"]):
        engine.add_request(str(i), PROMPTS[0], greedy(llm, name, 4))
    done = set()
    while engine.has_unfinished():
        running = {r.sampling_params.lora.name for r in engine.scheduler.running}
        assert len(running) <= 1
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"0", "1", "2", "3"}


def test_load_and_unload_at_run_time(llm, adapters) -> None:
    from engine.lora.registry import LoRAInUse

    engine = llm.engine
    adapter = engine.loras.read(str(adapters["a"]))
    ref = engine.add_lora("a2", adapter)
    assert ref.key == engine.loras.refs["a"].key  # the same weights: the same KV identity
    want = llm.generate([PROMPTS[0]], greedy(llm, "a"))[0].outputs[0].token_ids
    engine.add_request("busy", PROMPTS[0], greedy(llm, "a2"))
    with pytest.raises(LoRAInUse):
        engine.remove_lora("a2")
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == want
    engine.remove_lora("a2")
    assert "a2" not in engine.loras.refs
    with pytest.raises(ValueError, match="no longer loaded"):
        engine.add_request("gone", PROMPTS[0], SamplingParams(lora=ref))


def _broken(src, dst, edit) -> str:
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def test_bad_adapter_files_are_clear_errors(llama_dir, adapters, tmp_path, model_dirs) -> None:
    from safetensors.torch import load_file, save_file

    from engine.lora.registry import LoRALimits, LoRARegistry
    from models.loader import load_spec

    spec = load_spec(str(llama_dir))

    def read(path: str, max_rank: int = 64) -> None:
        LoRARegistry(LoRALimits(4, max_rank), spec, torch.float32).read(path)

    def rewrite(d, fn) -> None:
        f = d / "adapter_model.safetensors"
        save_file(fn(load_file(str(f))), str(f))

    def drop_b(d) -> None:
        rewrite(
            d,
            lambda t: {
                k: v for k, v in t.items() if not ("layers.1.mlp.up" in k and "lora_B" in k)
            },
        )

    def wrong_rank(d) -> None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg["r"] = 16
        (d / "adapter_config.json").write_text(json.dumps(cfg))

    cases = {
        "lacks lora_B": drop_b,
        "the config says 16": wrong_rank,
        "no adapter_model": lambda d: (d / "adapter_model.safetensors").unlink(),
        "DoRA": lambda d: (d / "adapter_config.json").write_text(
            json.dumps({**json.loads((d / "adapter_config.json").read_text()), "use_dora": True})
        ),
    }
    for i, (message, edit) in enumerate(cases.items()):
        with pytest.raises(LoRAError, match=message):
            read(_broken(adapters["a"], tmp_path / str(i), edit))
    with pytest.raises(LoRAError, match="exceeds --max-lora-rank 4"):
        read(str(adapters["b"]), max_rank=4)
    # an adapter made for another base model (smollm: hidden 96, not 64)
    other = make_adapter(model_dirs["smollm"], tmp_path / "smol", seed=3)
    with pytest.raises(LoRAError, match="another base model"):
        read(str(other))
    with pytest.raises(LoRAError, match="not a PEFT adapter"):
        read(str(tmp_path / "missing"))
    # and at startup: the engine does not start, saying which adapter
    with pytest.raises(ValueError, match="LoRA adapter 'x'"):
        LLM(str(llama_dir), num_kv_blocks=16, lora_modules=[f"x={other}"])


def test_a_gguf_lora_file_is_the_same_adapter(llama_dir, adapters, tmp_path) -> None:
    """llama.cpp's GGUF LoRA form of adapter a (q/k rows of B permuted, alpha in the metadata)
    reads back as the very same weights: the same fingerprint, the same tokens."""
    from tests.gguf_export import write_gguf_lora

    cfg = json.loads((llama_dir / "config.json").read_text())
    gguf_file = write_gguf_lora(adapters["a"], cfg, tmp_path / "a.gguf")
    llm = lora_llm(llama_dir, [f"a={adapters['a']}", f"g={gguf_file}"], num_kv_blocks=32)
    refs = llm.engine.loras.refs
    assert refs["g"].key == refs["a"].key
    a, g = (llm.generate(PROMPTS, greedy(llm, n))[0].outputs[0].token_ids for n in ("a", "g"))
    assert a == g


def test_speculation_and_grammars_are_unchanged_with_an_adapter(llama_dir, adapters) -> None:
    """Suffix drafts verified by the adapter's model: greedy tokens as without speculation; a
    JSON-schema request on an adapter gives JSON of that schema."""
    from engine.core.sampling_params import GrammarSpec

    modules = [f"a={adapters['a']}"]
    plain = lora_llm(llama_dir, modules, num_speculative_tokens=0)
    spec = lora_llm(
        llama_dir, modules, num_speculative_tokens=4, speculative_method="suffix", **PIN_K
    )
    for prompt in PROMPTS[:2]:
        want = plain.generate([prompt], greedy(plain, "a", 24))[0].outputs[0].token_ids
        for _ in range(2):  # the second time, drafts from the first answer (recent outputs)
            assert spec.generate([prompt], greedy(spec, "a", 24))[0].outputs[0].token_ids == want
    assert spec.engine.drafter is not None
    assert spec.engine.drafter.stats["suffix"].num_accepted_tokens > 20
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    out = plain.generate([PROMPTS[0]], greedy(plain, "a", 40, grammar=grammar))[0].outputs[0]
    assert isinstance(json.loads(out.text)["n"], int)


@pytest.mark.slow
def test_an_adapter_on_gguf_blocks_served_as_stored(smollm2_path, tmp_path) -> None:
    """The shipped Q4_1 file served as stored, with a random PEFT adapter of its shape, against
    transformers' dequantization of the same file with the adapter merged by PEFT: the same
    argmax at every prompt position and cosine > 0.9999 (the bar the file itself meets
    without an adapter, tests/test_gguf_blocks.py)."""
    import functools
    import os

    import gguf
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.core.scoring import score_prompt
    from models.gguf_loader import _Reader

    d, f = os.path.split(smollm2_path)
    with pytest.MonkeyPatch.context() as patch:  # test_smollm2.py's two speed-ups
        patch.setattr(gguf, "GGUFReader", _Reader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        hf = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(hf, cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    peft_model.save_pretrained(tmp_path / "smol-lora")
    merged = peft_model.merge_and_unload()
    llm = LLM(
        smollm2_path,
        num_kv_blocks=32,
        dtype="float32",
        gguf_int8_activations="off",
        num_speculative_tokens=0,
        target_step_ms=-1,
        lora_modules=[f"s={tmp_path / 'smol-lora'}"],
    )
    assert "GGUF blocks as stored (Q4_1 " in llm.engine.info.kernel_table
    assert "s (rank 8," in llm.engine.info.kernel_table  # the banner's adapter line
    tok = llm.tokenizer
    ids = tok.encode("The mitochondria is the part of the cell that")
    # prompt scoring through the engine's own prefill, served with the adapter
    ours = score_prompt(llm.engine, ids, llm.engine.loras.refs["s"])
    base = score_prompt(llm.engine, ids)
    with torch.no_grad():
        theirs = merged(torch.tensor([ids])).logits[0].float()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min() > 0.9999
    assert (ours - base).abs().max() > 0.1  # the adapter did change the logits


def test_lora_modules_settings(llama_dir, adapters) -> None:
    from engine.config import lora_modules

    path = str(adapters["a"])
    assert lora_modules([f"a={path}", json.dumps({"name": "b", "path": path})]) == {
        "a": path,
        "b": path,
    }
    for bad in (["a"], [f"a={path}", f"a={path}"], ['{"name": "x"}'], ["=p"]):
        with pytest.raises(ValueError, match="lora_modules entry"):
            lora_modules(bad)
    with pytest.raises(ValueError, match="max_loras 0"):
        LLM(str(llama_dir), num_kv_blocks=16, lora_modules=[f"a={path}"], max_loras=0)
    off = LLM(str(llama_dir), num_kv_blocks=16, max_loras=0)
    assert "lora: off" in off.engine.info.kernel_table
    with pytest.raises(LoRAError, match="LoRA is off"):
        off.engine.add_lora("a", off.engine.loras.read(path))


def test_lora_rides_on_top_of_whichever_method_serves() -> None:
    """A projection's LoRA method: the base product for every row and the adapter's update on
    its rows only; it stays on top when the format under it changes at load (oneDNN packing),
    and a step's adapter rows on a model whose projections take none are refused."""
    from torch import nn

    from models.linear.layer import Linear
    from models.lora import (
        LoRAOnTop,
        LoRAProjection,
        LoRARows,
        LoRAWeights,
        StepAdapters,
        enable_lora,
    )

    torch.manual_seed(0)
    block = nn.Module()
    block.o_proj = Linear(16, 24)
    block.o_proj.weight.data.normal_()
    a_t, b_t = torch.randn(16, 4), torch.randn(4, 24)
    adapter = LoRAWeights(4, ({"o_proj": LoRAProjection(a_t, b_t)},), "f", 0, ("o_proj",))
    rows = LoRARows(((adapter, slice(1, 3)),))
    with pytest.raises(ValueError, match="take no adapters"):
        with StepAdapters().serving(rows):
            pass
    step = StepAdapters()
    enable_lora(nn.ModuleList([block]), step)
    layer = block.o_proj
    assert isinstance(layer.method, LoRAOnTop) and layer.dense
    x = torch.randn(5, 16)
    want = x @ layer.weight.T
    want[1:3] += x[1:3] @ a_t @ b_t
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T, atol=1e-4)  # no step: the base
        for _ in range(2):
            with step.serving(rows):
                assert torch.allclose(layer(x), want, atol=1e-4)
            layer.pack()  # the second round: on the packed format where oneDNN packs here
    assert isinstance(layer.method, LoRAOnTop) and layer.method.base is layer.format
