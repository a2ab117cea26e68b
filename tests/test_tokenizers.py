"""Tokenizers from tokenizer.json, tokenizer.model and GGUF; incremental detokenization; chat
templates; stop strings."""

from __future__ import annotations

import json

import pytest

from engine.core.detokenizer import IncrementalDetokenizer
from models.chat_template import TemplateError, render_chat
from models.tokenizer import load_tokenizer
from tests.conftest import CORPUS

TEXTS = [
    "Hello world, how are you?",
    "日本語のテキストと絵文字 🎉🚀 も含まれています。",
    "  two leading spaces, then   three inside.",
    "naïve café — “quotes” ✓",
]


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(CORPUS + TEXTS))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(d / "tokenizer"),
        vocab_size=500,
        minloglevel=2,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
    )
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return d


def stream(tok, ids, stop=()):
    detok = IncrementalDetokenizer(tok, [], list(stop))
    pieces = []
    for i, t in enumerate(ids):
        matched = detok.add([t])
        pieces.append(detok.flush(matched is not None or i == len(ids) - 1))
        if matched is not None:
            return pieces, matched
    return pieces, None


@pytest.mark.parametrize("kind", ["tokenizer.json", "sentencepiece", "gguf"])
def test_incremental_detokenization_is_exact(kind, llama_dir, spm_dir, smollm2_path) -> None:
    path = {"tokenizer.json": llama_dir, "sentencepiece": spm_dir, "gguf": smollm2_path}[kind]
    tok = load_tokenizer(str(path))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces, _ = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids), (kind, text)
        assert all("\ufffd" not in p for p in pieces), (kind, text)
        if kind != "sentencepiece":
            assert "".join(pieces) == text


def test_sentencepiece_adds_bos_and_keeps_spaces(spm_dir) -> None:
    tok = load_tokenizer(str(spm_dir))
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids) == "Hello world"


def test_stop_string_split_across_tokens_is_held_back(smollm2_path) -> None:
    tok = load_tokenizer(smollm2_path)
    ids = tok.encode("The answer is 42. STOP here please", add_special_tokens=False)
    pieces, matched = stream(tok, ids, stop=["STOP"])
    assert matched == "STOP"
    assert "".join(pieces) == "The answer is 42. "
    assert all("ST" not in p for p in pieces)


def test_chat_template_features() -> None:
    src = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    out = render_chat(src, [{"role": "user", "content": "hé"}], bos_token="<s>")
    assert out == '<s>"hé">'
    with pytest.raises(TemplateError, match="user first"):
        render_chat(src, [{"role": "system", "content": "x"}])
