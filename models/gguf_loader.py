"""GGUF checkpoints: hyper-parameters from metadata, tensors dequantized with the `gguf` package
and renamed to the model's parameter names. llama.cpp's converter permutes q/k rows of `llama`
models for its rotary layout; we undo that so the HF-style (rotate-half) decoder can use them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from models.checkpoint import Part, fuse_parts, to_tensor
from models.spec import ModelSpec, uniform_layers

_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
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


def gguf_spec(path: str) -> ModelSpec:
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
    tensor_names = {t.name for t in reader(path).tensors}
    tokens = field(path, "tokenizer.ggml.tokens")
    vocab = int(meta("vocab_size", len(tokens) if tokens else 0))
    scaling: dict | None = None
    if meta("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    if "rope_freqs.weight" in tensor_names:
        t = next(t for t in reader(path).tensors if t.name == "rope_freqs.weight")
        scaling = {"freq_factors": np.asarray(t.data, dtype=np.float64).tolist()}
    eos = field(path, "tokenizer.ggml.eos_token_id")
    eot = field(path, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
    bos = field(path, "tokenizer.ggml.bos_token_id")
    return ModelSpec(
        architecture=_ARCH_TO_HF[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        layers=uniform_layers(
            int(meta("block_count")), heads, kv_heads, head_dim, int(meta("feed_forward_length"))
        ),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        extra={"gguf_arch": arch},
    )


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, half, pair) back to (head, pair, half)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _model_name(name: str) -> tuple[str, str | None] | None:
    """(the model's parameter name, part of a fused parameter) for a GGUF tensor name."""
    if name in _NAMES:
        return _NAMES[name], None
    if name.startswith("blk."):
        _, idx, part, kind = name.split(".", 3)
        if part in _LAYER_NAMES:
            module, fused_part = _LAYER_NAMES[part]
            return f"layers.{idx}.{module}.{kind}", fused_part
    return None


def gguf_weights(path: str, spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors, dequantized to float32, under the model's parameter names."""
    return fuse_parts(spec, _gguf_parts(path, spec))


def gguf_blocks(
    path: str, spec: ModelSpec, formats: Iterable[str]
) -> dict[str, tuple[str, torch.Tensor]]:
    """The 2-D weights stored in one of `formats` ("Q4_1", ...) as their raw ggml blocks: the
    model's parameter name -> (format, uint8 [rows, bytes per row]), q/k rows un-permuted and
    fused parameters joined like the float tensors. A fused parameter whose parts differ in
    format is left out (it is served dense)."""
    wanted = {GGMLQuantizationType[f] for f in formats}
    kinds: dict[str, set[str]] = {}

    def raw_parts() -> Iterator[Part]:
        for t in reader(path).tensors:
            named = _model_name(t.name)
            if named is None or len(t.shape) != 2:
                continue
            kinds.setdefault(named[0], set()).add(t.tensor_type.name)
            if t.tensor_type in wanted:
                rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)
                yield named[0], named[1], _unpermuted(spec, named[1], rows)

    fused = dict(fuse_parts(spec, raw_parts(), complete=False))
    return {
        name: (next(iter(kinds[name])), data.contiguous())
        for name, data in fused.items()
        if len(kinds[name]) == 1
    }


def _unpermuted(spec: ModelSpec, part: str | None, rows: np.ndarray) -> torch.Tensor:
    """A tensor's rows (float or raw blocks) with llama.cpp's q/k permutation undone."""
    if spec.extra.get("gguf_arch") == "llama" and part in ("q", "k"):
        layer = spec.layers[0]
        rows = _unpermute(rows, layer.num_heads if part == "q" else layer.num_kv_heads)
    return torch.from_numpy(np.array(rows, order="C", copy=True))


def _gguf_parts(path: str, spec: ModelSpec) -> Iterator[Part]:
    permuted = spec.extra.get("gguf_arch") == "llama"
    layer = spec.layers[0]
    for t in tqdm(reader(path).tensors, desc="loading GGUF", unit="tensor"):
        named = _model_name(t.name)
        if named is None:
            continue  # rope_freqs and other metadata tensors are read by gguf_spec
        name, part = named
        shape = tuple(int(x) for x in reversed(t.shape))
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            array = np.asarray(t.data, dtype=np.float32).reshape(shape)
        else:
            array = dequantize(t.data, t.tensor_type).reshape(shape)
        if permuted and part == "q":
            array = _unpermute(array, layer.num_heads)
        elif permuted and part == "k":
            array = _unpermute(array, layer.num_kv_heads)
        yield name, part, to_tensor(array)
