"""Non-uniform and shared-KV models: OpenELM checkpoints (per-layer head counts and FFN widths,
q/k norms, tied embeddings), the same per-layer lists in a Llama config, and cross-layer KV
sharing (Gemma-3n's num_kv_shared_layers, CLA groups). Each is checked against a straightforward
reference written here (full recompute, no cache, no paging), batched and with prefix hits."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from models.openelm import make_divisible
from tests.conftest import build_tokenizer

VOCAB, DIM, HEAD_DIM = 512, 64, 16


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: [heads, seq, dim]; rotate-half RoPE at positions 0..seq-1."""
    d, n = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv).float()
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_logits(layers: list[dict], w: dict, tokens: list[int], theta: float) -> torch.Tensor:
    """Logits of the last position. layers[i]: heads, kv_heads, owner (layer whose K/V it
    reads), qk_norm; w: per-layer q/k/v/o, gate/up/down, norms; embed, norm, lm_head."""
    x = w["embed"][torch.tensor(tokens)]
    n = len(tokens)
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, lay in enumerate(layers):
        h = rms(x, w[f"{i}.attn_norm"])
        q = (h @ w[f"{i}.q"].t()).view(n, lay["heads"], HEAD_DIM).transpose(0, 1)
        if lay["qk_norm"]:
            q = rms(q, w[f"{i}.q_norm"])
        if lay["owner"] == i:
            k = (h @ w[f"{i}.k"].t()).view(n, lay["kv_heads"], HEAD_DIM).transpose(0, 1)
            v = (h @ w[f"{i}.v"].t()).view(n, lay["kv_heads"], HEAD_DIM).transpose(0, 1)
            if lay["qk_norm"]:
                k = rms(k, w[f"{i}.k_norm"])
            kv[i] = (rope(k, theta), v)
        k, v = kv[lay["owner"]]
        rep = lay["heads"] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = rope(q, theta) @ k.transpose(1, 2) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        x = x + o @ w[f"{i}.o"].t()
        h = rms(x, w[f"{i}.ffn_norm"])
        x = x + (F.silu(h @ w[f"{i}.gate"].t()) * (h @ w[f"{i}.up"].t())) @ w[f"{i}.down"].t()
    return rms(x, w["norm"])[-1] @ w["lm_head"].t()


def reference_greedy(layers, w, prompt: list[int], n: int, theta: float) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference_logits(layers, w, tokens, theta).argmax()))
    return tokens[len(prompt) :]


def random_weights(layers: list[dict], inters: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=g)

    w = {"embed": r(VOCAB, DIM), "norm": norm(DIM)}
    w["lm_head"] = w["embed"]
    for i, (lay, inter) in enumerate(zip(layers, inters)):
        w |= {
            f"{i}.attn_norm": norm(DIM),
            f"{i}.ffn_norm": norm(DIM),
            f"{i}.q": r(lay["heads"] * HEAD_DIM, DIM),
            f"{i}.k": r(lay["kv_heads"] * HEAD_DIM, DIM),
            f"{i}.v": r(lay["kv_heads"] * HEAD_DIM, DIM),
            f"{i}.o": r(DIM, lay["heads"] * HEAD_DIM),
            f"{i}.q_norm": norm(HEAD_DIM),
            f"{i}.k_norm": norm(HEAD_DIM),
            f"{i}.gate": r(inter, DIM),
            f"{i}.up": r(inter, DIM),
            f"{i}.down": r(DIM, inter),
        }
    return w


OPENELM_HEADS = [(4, 1), (8, 2), (6, 3)]  # (query heads, kv heads) per layer
OPENELM_FFN = [0.5, 2.0, 4.0]


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], cfg: dict) -> None:
    """A model directory: the tensors as model.safetensors, config.json and a tokenizer."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    build_tokenizer(out)


def write_openelm(out: Path) -> tuple[list[dict], dict]:
    out.mkdir(parents=True, exist_ok=True)
    layers = [
        {"heads": h, "kv_heads": kv, "owner": i, "qk_norm": True}
        for i, (h, kv) in enumerate(OPENELM_HEADS)
    ]
    inters = [make_divisible(m * DIM, 16) for m in OPENELM_FFN]
    w = random_weights(layers, inters, seed=1)
    t = {"transformer.token_embeddings.weight": w["embed"], "transformer.norm.weight": w["norm"]}
    for i in range(len(layers)):
        p = f"transformer.layers.{i}."
        t |= {
            p + "attn_norm.weight": w[f"{i}.attn_norm"],
            p + "ffn_norm.weight": w[f"{i}.ffn_norm"],
            p + "attn.qkv_proj.weight": torch.cat([w[f"{i}.q"], w[f"{i}.k"], w[f"{i}.v"]]),
            p + "attn.q_norm.weight": w[f"{i}.q_norm"],
            p + "attn.k_norm.weight": w[f"{i}.k_norm"],
            p + "attn.out_proj.weight": w[f"{i}.o"],
            p + "ffn.proj_1.weight": torch.cat([w[f"{i}.gate"], w[f"{i}.up"]]),
            p + "ffn.proj_2.weight": w[f"{i}.down"],
        }
    cfg = {
        "architectures": ["OpenELMForCausalLM"],
        "model_type": "openelm",
        "num_transformer_layers": len(layers),
        "model_dim": DIM,
        "head_dim": HEAD_DIM,
        "num_query_heads": [h for h, _ in OPENELM_HEADS],
        "num_kv_heads": [kv for _, kv in OPENELM_HEADS],
        "num_gqa_groups": 2,
        "ffn_multipliers": OPENELM_FFN,
        "ffn_dim_divisor": 16,
        "ffn_with_glu": True,
        "normalize_qk_projections": True,
        "share_input_output_layers": True,
        "rope_freq_constant": 10000,
        "rope_max_length": 4096,
        "max_context_length": 2048,
        "vocab_size": VOCAB,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    write_checkpoint(out, t, cfg)
    return layers, w


def write_shared_llama(
    out: Path, sharing: dict, per_layer: bool = False
) -> tuple[list[dict], dict]:
    """A Llama-config model with 4 layers and the given KV-sharing keys."""
    out.mkdir(parents=True, exist_ok=True)
    n = 4
    heads = [4, 2, 4, 4] if per_layer else [4] * n
    if "num_kv_shared_layers" in sharing:
        s = sharing["num_kv_shared_layers"]
        owner = [i if i < n - s else n - s - 1 for i in range(n)]
    elif "cla_group_size" in sharing:
        owner = [i // sharing["cla_group_size"] * sharing["cla_group_size"] for i in range(n)]
    else:
        owner = list(range(n))
    layers = [
        {"heads": heads[i], "kv_heads": 2, "owner": owner[i], "qk_norm": False} for i in range(n)
    ]
    w = random_weights(layers, [96] * n, seed=2)
    t = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["norm"]}
    for i in range(n):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": w[f"{i}.attn_norm"],
            p + "post_attention_layernorm.weight": w[f"{i}.ffn_norm"],
            p + "self_attn.q_proj.weight": w[f"{i}.q"],
            p + "self_attn.o_proj.weight": w[f"{i}.o"],
            p + "mlp.gate_proj.weight": w[f"{i}.gate"],
            p + "mlp.up_proj.weight": w[f"{i}.up"],
            p + "mlp.down_proj.weight": w[f"{i}.down"],
        }
        if owner[i] == i:
            t[p + "self_attn.k_proj.weight"] = w[f"{i}.k"]
            t[p + "self_attn.v_proj.weight"] = w[f"{i}.v"]
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": DIM,
        "head_dim": HEAD_DIM,
        "intermediate_size": 96,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **sharing,
    }
    write_checkpoint(out, t, cfg)
    return layers, w


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(24)]
    return [shared + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))] for _ in range(6)]


MODELS = {
    "openelm": lambda out: write_openelm(out),
    "gemma3n-shared": lambda out: write_shared_llama(out, {"num_kv_shared_layers": 2}),
    "cla2": lambda out: write_shared_llama(out, {"cla_group_size": 2}),
    "llama-per-layer-heads": lambda out: write_shared_llama(out, {}, per_layer=True),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_greedy_matches_reference(kind, tmp_path) -> None:
    layers, w = MODELS[kind](tmp_path / kind)
    ps = prompts()
    want = [reference_greedy(layers, w, p, 12, 10000.0) for p in ps]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tmp_path / kind), num_kv_blocks=64, block_size=4)
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in ps[:2]]
    batched = llm.generate(ps, params)  # after the first two: prefix hits on the shared 24
    assert alone == want[:2]
    assert [r.outputs[0].token_ids for r in batched] == want
    assert llm.engine.kv.prefix_hits > 0
    assert llm.engine.kv.pool.num_free_blocks == 64


def test_shared_kv_pool_holds_proportionally_more(tmp_path) -> None:
    """Same KV memory: 4 layers with 2 shared hold 4/2 = 2x the tokens; CLA-2 also 2x."""
    budget = "1MiB"
    sizes = {}
    for kind in ("llama-per-layer-heads", "gemma3n-shared", "cla2"):
        MODELS[kind](tmp_path / kind)
        llm = LLM(str(tmp_path / kind), kv_cache_memory=budget, block_size=4, max_num_seqs=4096)
        sizes[kind] = llm.engine.num_blocks
        groups = len(llm.engine.spec.kv_groups)
        assert groups == {"llama-per-layer-heads": 4, "gemma3n-shared": 2, "cla2": 2}[kind]
    assert sizes["gemma3n-shared"] == 2 * sizes["llama-per-layer-heads"]
    assert sizes["cla2"] == 2 * sizes["llama-per-layer-heads"]


def test_banner_reports_kv_sharing(tmp_path) -> None:
    from server.__main__ import kv_line

    MODELS["gemma3n-shared"](tmp_path / "m")
    llm = LLM(str(tmp_path / "m"), num_kv_blocks=16, block_size=4)
    line = kv_line(llm.engine.info)
    assert "in 2 KV groups (4 layers)" in line and "2.00x fewer than unshared" in line
