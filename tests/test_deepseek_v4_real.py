"""What a real DeepSeek V4 checkpoint needs beyond tests/test_deepseek_v4.py's tiny model: YaRN
ropes (DeepSeek's release scales the compress rope for the long context) and FP8 block-quantized
weights (float8_e4m3fn with a scale per block, edge blocks partial; routed experts FP4 with a
power-of-two scale per 32 values, as V4's release ships them), served dequantized.

One tiny model with YaRN on both ropes (attention factors not 1) runs once in transformers on a
prompt longer than the original context. Its weights are quantized here as the format stores
them, and the checkpoint transformers reads holds the dequantized values: the float32 checkpoint
and the FP8 one must both give transformers' logits and greedy tokens through the engine."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.core.sampling_params import SamplingParams
from engine.core.scoring import score_prompt
from models.deepseek_v4_load import v4_ropes
from models.fp8_weights import unpack_fp4
from models.layers import rope_attention_factor, rope_inv_freq
from tests.test_deepseek_v4 import CONFIG, FAST, build, cpp_everywhere

ROPES = {
    "main": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 8,
        "beta_slow": 1,
    },
    "compress": {
        "rope_type": "yarn",
        "rope_theta": 160000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
}
YARN = {**CONFIG, "rope_parameters": ROPES}
BLOCK = [24, 40]  # divides none of the tiny model's dims: every weight has partial edge blocks
PROMPT = [(i * 29 + 7) % 509 + 3 for i in range(80)]  # 80 tokens: past the original 32
NEW = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
_QUANTIZED = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wgate", "weights_proj", "shared_experts")


def blocks(grid: tuple[int, ...], block: list[int]) -> Iterator[tuple[int, int, tuple]]:
    """(i, j, the weight's slices) of each block of a grid of `block`-sized blocks."""
    for i in range(grid[0]):
        for j in range(grid[1]):
            yield (
                i,
                j,
                (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])),
            )


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As DeepSeek quantizes: per BLOCK block, scale = amax / 448; e4m3 values and 1 / scale's
    inverse (`weight_scale_inv`: the scale itself, what dequantization multiplies by)."""
    rows, cols = w.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scale = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i, j, part in blocks(grid, BLOCK):
        scale[i, j] = w[part].abs().amax().clamp(min=1e-12) / 448.0
        q[part] = (w[part] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 e2m1 with one power-of-two (ue8m0) scale per 32 values of a row: packed two a byte,
    low nibble first (int8), and the scales."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))  # the largest value fits e2m1's 6
    codes = torch.arange(16, dtype=torch.uint8)
    values = unpack_fp4(codes.view(torch.int8)[:, None])[:, 0]  # each code's value (low nibble)
    nearest = ((groups / scale[..., None])[..., None] - values).abs().argmin(-1)
    nearest = codes[nearest.reshape(rows, cols)]
    packed = nearest[:, 0::2] | (nearest[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantized_copy(q: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """The reference's own dequantization (loops over blocks, not models/fp8_weights.py's)."""
    values = unpack_fp4(q) if q.dtype == torch.int8 else q.float()
    out = torch.empty_like(values)
    for i, j, part in blocks(tuple(scale.shape), block):
        out[part] = values[part] * scale[i, j].float()
    return out


def quantize_checkpoint(plain: Path, fp8: Path) -> None:
    """`plain` (transformers' save) -> `fp8`: the attention, compressor, indexer and shared
    expert weights FP8 (scales as `weight_scale_inv`, in a second file), the routed experts FP4
    (scales as DeepSeek's `.scale`); `plain` is rewritten with the dequantized values."""
    tensors = load_file(plain / "model.safetensors")
    weights, scales = {}, {}
    for name, t in tensors.items():
        expert = ".experts." in name and ".shared_experts." not in name
        if not name.endswith(".weight") or not (expert or any(k in name for k in _QUANTIZED)):
            weights[name] = t
            continue
        if expert:
            q, s = fp4_rows(t)
            scales[name.removesuffix(".weight") + ".scale"] = s
            tensors[name] = dequantized_copy(q, s, [1, 32])
        else:
            q, s = fp8_blocks(t)
            scales[name + "_scale_inv"] = s
            tensors[name] = dequantized_copy(q, s, BLOCK)
        weights[name] = q
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    fp8.mkdir()
    for f in plain.iterdir():
        if f.suffix != ".safetensors":
            (fp8 / f.name).write_bytes(f.read_bytes())
    files = {
        "model-00001-of-00002.safetensors": weights,
        "model-00002-of-00002.safetensors": scales,
    }
    for fname, part in files.items():
        save_file(part, fp8 / fname, metadata={"format": "pt"})
    index = {"weight_map": {n: f for f, part in files.items() for n in part}}
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": BLOCK,
        "expert_dtype": "fp4",
    }
    (fp8 / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(float32 checkpoint of the dequantized weights, FP8 checkpoint), and transformers' logits
    and greedy tokens for PROMPT from the float32 one."""
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("dsv4real")
    build(root / "plain", YARN)
    quantize_checkpoint(root / "plain", root / "fp8")
    model = DeepseekV4ForCausalLM.from_pretrained(root / "plain", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
        greedy = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False)
    return root, logits, greedy[0, len(PROMPT) :].tolist()


def test_ropes_resolve_as_transformers_does() -> None:
    """DeepSeek's release form (one flat `rope_scaling`: YaRN on the compress rope only, its
    attention factor forced to 1), a flat one without an original context, nested pairs (YaRN
    with mscale; linear and llama3): each rope's frequencies and cos/sin factor are
    transformers' own."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    release = {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    forms = [
        {"rope_scaling": release},
        {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
        {"rope_parameters": ROPES},
        {"rope_parameters": {"main": {"rope_type": "linear", "factor": 2.0}, "compress": llama3}},
    ]
    for form in forms:
        cfg = {**CONFIG, "compress_rope_theta": 40000.0, **json.loads(json.dumps(form))}
        theirs = DeepseekV4RotaryEmbedding(DeepseekV4Config(**json.loads(json.dumps(cfg))))
        for label, (theta, scaling) in v4_ropes(cfg, 0.25).items():
            ours = rope_inv_freq(8, theta, scaling)
            assert torch.allclose(ours, getattr(theirs, f"{label}_inv_freq"), rtol=1e-6)
            factor = getattr(theirs, f"{label}_attention_scaling")
            assert math.isclose(rope_attention_factor(scaling), factor, rel_tol=1e-12)
    assert v4_ropes({**CONFIG, "rope_scaling": release}, 0.25)["main"][1] is None


def test_yarn_checkpoint_matches_transformers(ref) -> None:
    """YaRN on both ropes, a prompt past the original context: the whole prompt's logits, and
    greedy decoding batched with a shorter request, equal to transformers."""
    root, logits, greedy = ref
    llm = LLM(str(root / "plain"), num_kv_blocks=48, **FAST)
    ours = score_prompt(llm.engine, PROMPT)
    assert (ours - logits).abs().max().item() < 1e-4 * logits.abs().max().item()
    out = llm.generate([PROMPT, PROMPT[:20]], GREEDY)
    assert out[0].outputs[0].token_ids == greedy
    assert "FP8" not in llm.engine.info.kernel_table


def test_fp8_checkpoint_matches_transformers(ref) -> None:
    """The FP8 files (weights and scales in different files, both scale names, FP4 experts)
    load to the dequantized weights and give transformers' logits and greedy tokens (with the
    C++ decode ops too); the banner says they are served dequantized and what that costs."""
    root, logits, greedy = ref
    llm = LLM(str(root / "fp8"), num_kv_blocks=48, max_num_batched_tokens=30, **FAST)
    ours = score_prompt(llm.engine, PROMPT)
    assert (ours - logits).abs().max().item() < 1e-4 * logits.abs().max().item()
    assert llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids == greedy
    with cpp_everywhere(llm):  # the C++ decode ops take the YaRN-scaled cos/sin tables too
        assert llm.generate([PROMPT, PROMPT[:20]], GREEDY)[0].outputs[0].token_ids == greedy
    weights = next(x for x in llm.engine.info.kernel_table.splitlines() if "weights:" in x)
    assert "FP8 e4m3 weights in 24x40 blocks (float scales); FP4 (e2m1) routed experts" in weights
    assert "served dequantized: " in weights and "GiB of files" in weights


def test_fp8_checkpoint_in_bfloat16(ref) -> None:
    """Dequantized to bfloat16 (a real checkpoint's serving dtype): as close to the float32
    logits as transformers' own bfloat16 run of the same weights is."""
    from transformers import DeepseekV4ForCausalLM

    root, logits, _ = ref
    llm = LLM(str(root / "fp8"), num_kv_blocks=48, **{**FAST, "dtype": "bfloat16"})
    ours = score_prompt(llm.engine, PROMPT)
    model = DeepseekV4ForCausalLM.from_pretrained(root / "plain", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - logits).abs().max() <= 1.25 * (theirs - logits).abs().max()
    agree = [(x.argmax(-1) == logits.argmax(-1)).float().mean().item() for x in (ours, theirs)]
    assert agree[0] >= agree[1] - 0.05
    assert "bfloat16 (the serving dtype)" in llm.engine.info.kernel_table


def test_other_quantization_is_refused(ref, tmp_path) -> None:
    """Another quantization method, or FP8 with static activation scales: startup errors
    with the reason."""
    root = ref[0]
    for q, why in [
        ({"quant_method": "awq", "bits": 4}, "awq quantized weights are not supported"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": BLOCK},
            "static activation scales",
        ),
    ]:
        other = tmp_path / q["quant_method"] / q.get("activation_scheme", "")
        other.mkdir(parents=True)
        for f in (root / "fp8").iterdir():
            (other / f.name).symlink_to(f)
        (other / "config.json").unlink()
        cfg = json.loads((root / "fp8" / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
        with pytest.raises(ValueError, match=why):
            LLM(str(other), num_kv_blocks=48, **FAST)


def test_yarn_on_the_shared_decoder(tmp_path) -> None:
    """The YaRN V4 uses is models/layers.py's, which the shared decoder takes too: a Qwen2 with
    YaRN past its original context (attention factor 0.1 ln 4 + 1) gives transformers' logits."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import build_model

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    path = build_model("qwen2", tmp_path / "qwen2", rope_parameters=yarn)
    llm = LLM(str(path), num_kv_blocks=48, **FAST)
    assert llm.engine.spec.rope_scaling["rope_type"] == "yarn"
    ours = score_prompt(llm.engine, PROMPT)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        theirs = model(torch.tensor([PROMPT])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4 * theirs.abs().max().item()
