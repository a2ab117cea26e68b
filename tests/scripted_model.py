"""A tiny Llama that says what a test scripts: greedy, it answers any prompt with the given
tokens and then its end token. Its layers add nothing to the residual stream (attention and MLP
outputs zeroed), so the next token depends on the current one only, and the head maps the
generation prompt's last token to the script's first, each script token to the next, the last
to the end token. The forward still runs every op the server runs (paged attention, norms, the
sampler); only the weights are made to be read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer

from tests.conftest import build_model

THINK_TOKENS = ("<think>", "</think>")


def scripted_model(
    out: Path,
    template: str,
    script: list[str],
    tokenizer_from: Path | None = None,
) -> Path:
    """`script`: the answer as strings each of one token. `tokenizer_from`: a directory whose
    tokenizer.json and tokenizer_config.json to serve with (a real model's), else the tests'
    tokenizer with `<think>` and `</think>` added as tokens."""
    if tokenizer_from is not None:
        vocab = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json")).get_vocab_size()
        path = build_model("llama", out, vocab_size=vocab, eos_token_id=_eos_of(tokenizer_from))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, path / name)
    else:
        path = build_model("llama", out)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
        tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    _script_weights(path, script)
    return path


def silence_layers(model: transformers.PreTrainedModel) -> None:
    """Zero every layer's attention and MLP outputs: the residual stream stays the current
    token's embedding, so the next token depends on it alone."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def _eos_of(tokenizer_dir: Path) -> int:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = config["eos_token"]
    eos = eos["content"] if isinstance(eos, dict) else eos
    return tok.token_to_id(eos)


def _script_weights(path: Path, script: list[str]) -> None:
    from models.tokenizer import load_tokenizer

    tok = load_tokenizer(str(path))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    chain = [tok.encode(prompt, add_special_tokens=False)[-1]]
    for text in script:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == 1, f"{text!r} is {len(ids)} tokens in this tokenizer"
        chain += ids
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    chain.append(model.config.eos_token_id)
    assert len(set(chain)) == len(chain), f"a token twice in the script's chain {chain}"
    with torch.no_grad():
        silence_layers(model)
        emb, gain = model.model.embed_tokens.weight, model.model.norm.weight
        for current, following in zip(chain, chain[1:]):
            h = emb[current] * torch.rsqrt(emb[current].pow(2).mean() + 1e-6) * gain
            model.lm_head.weight[following] = 5.0 * h / h.norm()
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200KB")
