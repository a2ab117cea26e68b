"""The Llama family's HF tensor names under "model.layers.N." -> (the model's own name under
"layers.N.", the part of a fused parameter it fills): the rows every HF loader of a Llama-family
decoder shares (models/loader.py, gemma4.py, laguna.py), each adding its architecture's own."""

from __future__ import annotations

LayerNames = dict[str, tuple[str, str | None]]

# attention: the input norm, q/k/v fused into one qkv_proj, Qwen3's q/k norms, o_proj
HF_ATTENTION_NAMES: LayerNames = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attn.q_proj.weight": ("qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("qkv_proj.weight", "v"),
    "self_attn.q_norm.weight": ("q_norm.weight", None),
    "self_attn.k_norm.weight": ("k_norm.weight", None),
    "self_attn.o_proj.weight": ("o_proj.weight", None),
}
# the gated FFN's projections -> the model's: gate and up fused into one gate_up_proj, then
# down_proj (a dense FFN's, a shared expert's, each routed expert's)
GATED_MLP_PARTS: dict[str, tuple[str, str | None]] = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", None),
}


def gated_mlp_names(prefix: str, own_prefix: str) -> LayerNames:
    """The gated FFN's weights under the HF `prefix` ("mlp.") as the model names them under
    `own_prefix`."""
    return {
        f"{prefix}{hf}.weight": (f"{own_prefix}{own}.weight", part)
        for hf, (own, part) in GATED_MLP_PARTS.items()
    }


HF_MLP_NAMES: LayerNames = gated_mlp_names("mlp.", "")
