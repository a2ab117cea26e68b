"""GGUF checkpoints: hyper-parameters from metadata, tensors dequantized with the `gguf` package
and renamed to the model's parameter names. llama.cpp's converter permutes q/k rows of `llama`
models for its rotary layout; we undo that so the HF-style (rotate-half) decoder can use them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import lru_cache

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from models.checkpoint import Part, fuse_parts, to_tensor
from models.spec import ModelSpec, uniform_layers

_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",  # Mixtral too (`expert_count`): MixtralForCausalLM
    "mistral3": "MistralForCausalLM",  # llama.cpp's name for Mistral Small 3 / Ministral's text
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# llama.cpp's converter permutes q/k rows of these for its rotary layout (undone at load)
_PERMUTED = {"llama", "mistral3"}
# GGUF tensor names -> the model's. Top level:
_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
# "blk.N.<part>.<kind>" -> ("layers.N.<module>.<kind>", part of a fused parameter).
_LAYER_NAMES: dict[str, tuple[str, str | None]] = {
    "attn_norm": ("input_layernorm", None),
    "attn_q": ("qkv_proj", "q"),
    "attn_k": ("qkv_proj", "k"),
    "attn_v": ("qkv_proj", "v"),
    "attn_output": ("o_proj", None),
    "attn_q_norm": ("q_norm", None),
    "attn_k_norm": ("k_norm", None),
    "ffn_norm": ("post_attention_layernorm", None),
    "ffn_gate": ("gate_up_proj", "gate"),
    "ffn_up": ("gate_up_proj", "up"),
    "ffn_down": ("down_proj", None),
    "ffn_gate_inp": ("moe.router", None),
}
# Per architecture, where its names differ from the table above. Gemma 3: the sandwich norms
# (its converter has already added Gemma's `1 +` to every norm weight); Phi-3: fused q/k/v and
# [gate ; up] stored whole.
_ARCH_LAYER_NAMES: dict[str, dict[str, tuple[str, str | None]]] = {
    "gemma3": {
        "post_attention_norm": ("attn_output_norm", None),
        "post_ffw_norm": ("ffn_output_norm", None),
    },
    "phi3": {"attn_qkv": ("qkv_proj", None), "ffn_up": ("gate_up_proj", None)},
}
# A mixture-of-experts layer's experts, stacked [experts, rows, columns]: one 2-D matrix each
_EXPERT_TENSORS = {
    "ffn_gate_exps": ("gate_up_proj", "gate"),
    "ffn_up_exps": ("gate_up_proj", "up"),
    "ffn_down_exps": ("down_proj", None),
}


class _Reader(GGUFReader):
    """The `gguf` package's reader over a plain ndarray view of its memory map. It slices its
    `data` once or more per metadata value, and each slice of a `np.memmap` runs memmap's
    Python-level `__array_finalize__`: ~1M times for SmolLM2's 49k-token vocabulary and merges,
    3.1 s of every start (0.9 s this way). The view keeps the map alive."""

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


@lru_cache(maxsize=4)
def reader(path: str) -> GGUFReader:
    return _Reader(path)


def field(path: str, key: str, default: object = None) -> object:
    f = reader(path).fields.get(key)
    return default if f is None else f.contents()


def gguf_spec(path: str, context: int | None = None) -> ModelSpec:
    """The file's geometry; `context` (the served max_model_len) picks Phi-3's LongRoPE set."""
    arch = str(field(path, "general.architecture"))
    if arch not in _ARCH_TO_HF:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCH_TO_HF)}"
        )

    def meta(key: str, default: object = None) -> object:
        return field(path, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", hidden // heads))
    n_layers = int(meta("block_count"))
    tensors = {t.name: t for t in reader(path).tensors}
    tokens = field(path, "tokenizer.ggml.tokens")
    vocab = int(meta("vocab_size", len(tokens) if tokens else 0))
    rope_kind = meta("rope.scaling.type")
    scaling: dict | None = None
    if rope_kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif rope_kind not in (None, "none") and arch != "phi3":
        raise ValueError(f"GGUF rope scaling {rope_kind!r} is not supported")
    if "rope_freqs.weight" in tensors:
        freqs = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64).tolist()
        scaling = {"freq_factors": freqs}
    eos = field(path, "tokenizer.ggml.eos_token_id")
    eot = field(path, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    bos = field(path, "tokenizer.ggml.bos_token_id")
    experts = int(meta("expert_count", 0) or 0)
    ffn = int(meta("expert_feed_forward_length", 0) or 0) if experts else 0
    layers = tuple(
        replace(
            lay,
            num_experts=experts,
            num_experts_per_tok=int(meta("expert_used_count", 0)),
            intermediate_size=ffn or lay.intermediate_size,
        )
        for lay in uniform_layers(
            n_layers, heads, kv_heads, head_dim, int(meta("feed_forward_length", 0) or 0)
        )
    )
    hf_arch = "MixtralForCausalLM" if arch == "llama" and experts else _ARCH_TO_HF[arch]
    spec = ModelSpec(
        architecture=hf_arch,
        vocab_size=vocab,
        hidden_size=hidden,
        layers=layers,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        sliding_window=meta("attention.sliding_window"),
        moe_renormalize=bool(meta("expert_weights_norm", True)),
        extra={"gguf_arch": arch},
    )
    if arch == "gemma3":
        return replace(spec, **_gemma3_fields(meta, n_layers, hidden, heads))
    if arch == "phi3":
        return replace(spec, **_phi3_fields(meta, tensors, head_dim, context))
    return spec


def _gemma3_fields(meta: Callable[..., object], n_layers: int, hidden: int, heads: int) -> dict:
    """llama.cpp's Gemma 3: every sixth layer global, a local rope base of 10,000 unless the file
    says otherwise, and the 27B model (62 layers) alone scaled by hidden / heads."""
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer, True where windowed
        full = tuple(i for i, windowed in enumerate(pattern) if not windowed)
    else:
        every = int(pattern or 6)
        full = tuple(i for i in range(n_layers) if i % every == every - 1)
    return dict(
        full_attention_layers=full,
        local_rope_theta=float(meta("rope.freq_base_swa", 10000.0)),
        hidden_act="gelu_pytorch_tanh",
        embedding_multiplier=hidden**0.5,
        sandwich_norms=True,
        attention_scale=(hidden / heads) ** -0.5 if n_layers == 62 else None,
        final_logit_softcap=meta("final_logit_softcapping"),
    )


def _phi3_fields(
    meta: Callable[..., object], tensors: dict, head_dim: int, context: int | None
) -> dict:
    """Phi-3's partial rotary (`rope.dimension_count`) and LongRoPE factors (two tensors)."""
    fields: dict = {"partial_rotary_factor": int(meta("rope.dimension_count", head_dim)) / head_dim}
    if "rope_factors_long.weight" in tensors:
        longest = int(meta("context_length", 4096))
        original = int(meta("rope.scaling.original_context_length", longest))

        def factors(name: str) -> list[float]:
            return np.asarray(tensors[name].data, dtype=np.float64).tolist()

        fields["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": factors("rope_factors_short.weight"),
            "long_factor": factors("rope_factors_long.weight"),
            "original_max_position_embeddings": original,
            "factor": longest / original,
            "attention_factor": meta("rope.scaling.attn_factor"),
            "use_long": (context or longest) > original,
        }
    return fields


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, half, pair) back to (head, pair, half)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _model_names(t: ReaderTensor, arch: str) -> list[tuple[str, str | None, int | None]]:
    """(the model's parameter name, part of a fused parameter, expert index) for a GGUF tensor:
    one entry, or one per expert of a stacked expert tensor (`ffn_*_exps`: the expert indexes
    its first numpy dimension); [] for a tensor the model does not hold."""
    if t.name in _NAMES:
        return [(_NAMES[t.name], None, None)]
    if not t.name.startswith("blk."):
        return []  # rope_freqs and other metadata tensors are read by gguf_spec
    _, idx, part, kind = t.name.split(".", 3)
    table = _ARCH_LAYER_NAMES.get(arch, {})
    if part in table or part in _LAYER_NAMES:
        module, fused_part = table.get(part) or _LAYER_NAMES[part]
        return [(f"layers.{idx}.{module}.{kind}", fused_part, None)]
    if part in _EXPERT_TENSORS:
        module, fused_part = _EXPERT_TENSORS[part]
        return [
            (f"layers.{idx}.moe.experts.{e}.{module}.{kind}", fused_part, e)
            for e in range(int(t.shape[-1]))
        ]
    return []


def gguf_weights(path: str, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, dequantized to float32, under the model's parameter names."""
    return fuse_parts(spec, _gguf_parts(path, spec))


def gguf_blocks(
    path: str, spec: ModelSpec, formats: Iterable[str]
) -> dict[str, tuple[str, torch.Tensor]]:
    """The 2-D weights (and each expert's matrix of a stacked 3-D one) stored in one of
    `formats` ("Q4_1", ...) as their raw ggml blocks: the model's parameter name -> (format,
    uint8 [rows, bytes per row]), q/k rows un-permuted and fused parameters joined like the
    float tensors. A fused parameter whose parts differ in format is left out (served dense)."""
    wanted = {GGMLQuantizationType[f] for f in formats}
    kinds: dict[str, set[str]] = {}
    arch = str(spec.extra.get("gguf_arch"))

    def raw_parts() -> Iterator[Part]:
        for t in reader(path).tensors:
            if len(t.shape) not in (2, 3):
                continue
            for name, part, expert in _model_names(t, arch):
                kinds.setdefault(name, set()).add(t.tensor_type.name)
                if t.tensor_type in wanted:
                    experts = int(t.shape[2]) if len(t.shape) == 3 else 1
                    rows = np.asarray(t.data).reshape(experts, int(t.shape[1]), -1)[expert or 0]
                    yield name, part, torch.from_numpy(_unpermuted(spec, part, rows))

    fused = dict(fuse_parts(spec, raw_parts(), complete=False))
    return {
        name: (next(iter(kinds[name])), data.contiguous())
        for name, data in fused.items()
        if len(kinds[name]) == 1
    }


def _unpermuted(spec: ModelSpec, part: str | None, rows: np.ndarray) -> np.ndarray:
    """A tensor's rows (float or raw blocks), a C-ordered copy, llama.cpp's q/k permutation
    undone."""
    if spec.extra.get("gguf_arch") in _PERMUTED and part in ("q", "k"):
        layer = spec.layers[0]
        rows = _unpermute(rows, layer.num_heads if part == "q" else layer.num_kv_heads)
    return np.array(rows, order="C", copy=True)


def float_array(t: ReaderTensor) -> np.ndarray:
    """A tensor's values as float32, in numpy's order (the reverse of ggml's shape)."""
    shape = tuple(int(x) for x in reversed(t.shape))
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    return dequantize(t.data, t.tensor_type).reshape(shape)


def _gguf_parts(path: str, spec: ModelSpec) -> Iterator[Part]:
    arch = str(spec.extra.get("gguf_arch"))
    for t in tqdm(reader(path).tensors, desc="loading GGUF", unit="tensor"):
        names = _model_names(t, arch)
        if not names:
            continue
        array = float_array(t)
        for name, part, expert in names:
            matrix = array if expert is None else array[expert]
            yield name, part, to_tensor(_unpermuted(spec, part, matrix))


def gguf_lora_tensors(
    path: str, spec: ModelSpec
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """A GGUF LoRA file (llama.cpp's convert_lora_to_gguf.py): its metadata and its tensors
    ("blk.N.attn_q.weight.lora_a" [r, in], "...lora_b" [out, r]) as float32, lora_b's q/k rows
    un-permuted where the file's architecture permutes them (A's rows are the rank's); no
    tensors unless the file says it is an adapter."""
    r = _Reader(path)  # not the cached `reader`: an adapter is read once
    meta = {
        key: f.contents() for key, f in r.fields.items() if key.startswith(("general.", "adapter."))
    }
    if meta.get("general.type") != "adapter":
        return meta, {}  # a model file, say: not dequantized only to be refused
    permuted = meta.get("general.architecture") in _PERMUTED
    layer = spec.layers[0]
    tensors = {}
    for t in r.tensors:
        array = float_array(t)
        if permuted and t.name.endswith(".lora_b") and t.name.split(".")[2] in ("attn_q", "attn_k"):
            heads = layer.num_heads if t.name.split(".")[2] == "attn_q" else layer.num_kv_heads
            if array.shape[0] % (2 * heads) == 0:
                array = _unpermute(array, heads)
        tensors[t.name] = to_tensor(array)
    return meta, tensors
