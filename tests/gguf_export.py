"""Write a tiny HF checkpoint as a GGUF file the way llama.cpp's `convert_hf_to_gguf.py` does, for
the architectures kvserve reads from GGUF: its tensor names, its q/k row permutation (`llama`,
`mistral3`), Gemma's `1 +` folded into norm weights, Phi-3's fused tensors and LongRoPE factor
tensors, experts stacked into 3-D tensors, and the tokenizer as a `gpt2` vocabulary.

tests/test_model_coverage.py checks the files against transformers' own GGUF reader where it
has the architecture, so these conventions are llama.cpp's and not merely kvserve's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model (images: mmproj_export.py)
    "Phi3ForCausalLM": "phi3",
}
_PERMUTED = {"llama", "mistral3"}

# HF names under "model.layers.N." -> GGUF's under "blk.N." (Llama family)
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: [gate ; up] as one tensor
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
}
_GEMMA3_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down"}
_EXPERT["w2"] = "down"


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute` of q/k rows: (head, pair, half) -> (head, half, pair)."""
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _tensors(cfg: dict, arch: str, hf: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in hf.items():
        a = t.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = a
        elif name == "model.norm.weight":
            out["output_norm.weight"] = a
        elif name == "lm_head.weight":
            out["output.weight"] = a
        else:
            idx, rest = name[len("model.layers.") :].split(".", 1)
            module = rest.rsplit(".", 1)[0]
            if ".experts." in module:
                _, e, kind = module.rsplit(".", 2)
                experts.setdefault((idx, _EXPERT[kind]), {})[int(e)] = a
                continue
            gname = (_GEMMA3_LAYER if arch == "gemma3" else {}).get(module) or _LAYER[module]
            if arch in _PERMUTED and gname == "attn_q":
                a = _permute(a, heads)
            elif arch in _PERMUTED and gname == "attn_k":
                a = _permute(a, kv_heads)
            out[f"blk.{idx}.{gname}.weight"] = a
    for (idx, kind), per in experts.items():
        out[f"blk.{idx}.ffn_{kind}_exps.weight"] = np.stack([per[e] for e in sorted(per)])
    return out


def write_gguf(
    hf_dir: Path,
    out: Path,
    matrix_type: str = "F32",
    arch: str | None = None,
    unused_tokens: tuple[str, ...] = (),
) -> Path:
    """`hf_dir`'s checkpoint and tokenizer as `out`; 2-D and 3-D weights in `matrix_type`
    ("F32", "Q8_0"), norms and routers in F32, as llama.cpp's converter writes them; `arch`
    overrides the file's architecture name (`mistral3` for a Mistral). A vision-language
    checkpoint gives its language model, as the converter's text class reads it (the tower
    goes to an mmproj file). `unused_tokens` are written as unused `[PAD<id>]` entries, as the
    converter leaves Gemma 3's `<image_soft_token>`."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or GGUF_ARCH[cfg["architectures"][0]]
    if "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    w = gguf.GGUFWriter(str(out), arch)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        rope = rope.get("full_attention", {})
        w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    hf = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    hf = {_text_name(name): t for name, t in hf.items() if _text_name(name)}
    tensors = _tensors(cfg, arch, hf)
    if arch == "phi3":
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        w.add_rope_dimension_count(int(head_dim * factor))
        if rope.get("rope_type") == "longrope":
            original = cfg["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(original)
            scale = cfg["max_position_embeddings"] / original
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
            tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
            tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    _add_tokenizer(w, hf_dir, cfg, unused_tokens)
    qtype = gguf.GGMLQuantizationType[matrix_type]
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if matrix_type == "F32" or a.ndim < 2 or "gate_inp" in name or "norm" in name:
            w.add_tensor(name, a)
        else:
            add_blocks(w, name, a, qtype)
    return finish(w, out)


def add_blocks(w, name: str, a: np.ndarray, qtype) -> None:  # w: gguf.GGUFWriter
    """`a` as `qtype` blocks, by the `gguf` package's quantizer."""
    import gguf

    q = gguf.quants.quantize(a, qtype)
    w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)


def finish(w, out: Path) -> Path:  # w: gguf.GGUFWriter
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _text_name(name: str) -> str:
    """A checkpoint tensor's name as the text model's ("" for the image path's): a
    ConditionalGeneration's language model under "model.", as in a CausalLM."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith(
        (
            "vision_tower.",
            "multi_modal_projector.",
            "model.vision_tower.",
            "model.multi_modal_projector.",
        )
    ):
        return ""
    return name.replace("language_model.", "", 1) if name.startswith("language_model.") else name


def _add_tokenizer(w, hf_dir: Path, cfg: dict, unused: tuple[str, ...] = ()) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())  # w: gguf.GGUFWriter
    vocab = tok["model"]["vocab"]
    tokens = [""] * cfg["vocab_size"]
    types = [1] * cfg["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    for i in range(len(vocab), cfg["vocab_size"]):  # the embedding's rows past the vocabulary
        tokens[i], types[i] = f"[PAD{i}]", 5
    for added in tok.get("added_tokens", []):
        types[added["id"]] = 3
    for i, text in enumerate(list(tokens)):
        if text in unused:
            tokens[i], types[i] = f"[PAD{i}]", 5
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    template = json.loads((hf_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_chat_template(template)


def write_gguf_lora(peft_dir: Path, base_cfg: dict, out: Path) -> Path:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: "blk.N.attn_q.weight
    .lora_a" [r, in] and ".lora_b" [out, r] (lora_b's q/k rows in llama.cpp's permuted order,
    as the base file's q/k weights are), F32, general.type adapter, adapter.lora.alpha."""
    import gguf

    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(cfg["lora_alpha"]))
    heads, kv_heads = base_cfg["num_attention_heads"], base_cfg["num_key_value_heads"]
    for name, t in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        module, ab = name.removeprefix("base_model.model.model.layers.").split(".lora_")
        idx, rest = module.split(".", 1)
        gname = _LAYER[rest]
        a = t.float().numpy()
        if ab.startswith("B") and gname in ("attn_q", "attn_k"):
            a = _permute(a, heads if gname == "attn_q" else kv_heads)
        w.add_tensor(f"blk.{idx}.{gname}.weight.lora_{ab[0].lower()}", np.ascontiguousarray(a))
    return finish(w, out)
