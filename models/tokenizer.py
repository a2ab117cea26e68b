"""Tokenizers for every checkpoint kind: `tokenizer.json` (HF `tokenizers`), `tokenizer.model`
(sentencepiece), and the vocabulary embedded in a GGUF file (rebuilt as a `tokenizers` model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from models.chat_template import render_chat

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_GGUF_SPECIAL_TYPES = {3, 4}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """One interface over the backends. Token ids are ints; text is str."""

    def __init__(
        self,
        backend: Any,
        kind: str,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos_token: bool,
        special_ids: set[int],
    ) -> None:
        self._backend = backend
        self.kind = kind  # "tokenizers" or "sentencepiece"
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.special_ids = special_ids

    # ---- basic operations --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self.kind == "sentencepiece":
            return self._backend.get_piece_size()
        return self._backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        if self.kind == "sentencepiece":
            if 0 <= token_id < self._backend.get_piece_size():
                return self._backend.id_to_piece(token_id)
            return None
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        if self.kind == "sentencepiece":
            i = self._backend.piece_to_id(token)
            return None if i == self._backend.unk_id() and token != self.id_to_token(i) else i
        return self._backend.token_to_id(token)

    def mark_special(self, token_id: int) -> None:
        """Read the text of vocabulary entry `token_id` as that one token (an entry the loader
        chose to hold an image's positions: models/mmproj.py)."""
        text = self.id_to_token(token_id)
        if self.kind != "tokenizers" or text is None:
            raise ValueError(f"token id {token_id} cannot be made a special token here")
        self._backend.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        self.special_ids = self.special_ids | {token_id}

    @property
    def bos_token(self) -> str:
        return (self.id_to_token(self.bos_token_id) or "") if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return (self.id_to_token(self.eos_token_id) or "") if self.eos_token_id is not None else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.kind == "sentencepiece":
            ids = list(self._backend.encode(text))
        else:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def encode_for_embedding(self, text: str) -> list[int]:
        """`encode`, then what the tokenizer.json post-processor appends after the text, as
        transformers' `tokenizer(text)` has it: Qwen3-Embedding's post-processor appends
        <|endoftext|>, the token its last-token pooling reads."""
        ids = self.encode(text)
        if self.kind == "sentencepiece":
            return ids
        plain = self._backend.encode(text, add_special_tokens=False).ids
        full = self._backend.encode(text, add_special_tokens=True).ids
        for start in range(len(full) - len(plain) + 1):
            if full[start : start + len(plain)] == plain:
                return ids + full[start + len(plain) :]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        if self.kind == "sentencepiece":
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API")
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )


# ---- loading ------------------------------------------------------------------------------------


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_tokenizer(path: str) -> Tokenizer:
    if path.endswith(".gguf"):
        return _gguf_tokenizer(path)
    root = Path(path)
    cfg: dict[str, Any] = {}
    if (root / "tokenizer_config.json").is_file():
        cfg = json.loads((root / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    bos, eos = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
    if (root / "tokenizer.json").is_file():
        backend = HFTokenizer.from_file(str(root / "tokenizer.json"))
        backend.no_padding()
        backend.no_truncation()
        special = {t.id for t in _added_tokens(root / "tokenizer.json") if t.special}
        bos_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        add_bos = bool(cfg.get("add_bos_token", _post_processor_adds_bos(root / "tokenizer.json")))
        return Tokenizer(backend, "tokenizers", bos_id, eos_id, template, add_bos, special)
    if (root / "tokenizer.model").is_file():
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(root / "tokenizer.model"))
        bos_id = sp.bos_id() if sp.bos_id() >= 0 else None
        eos_id = sp.eos_id() if sp.eos_id() >= 0 else None
        special = {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        add_bos = bool(cfg.get("add_bos_token", True))
        return Tokenizer(sp, "sentencepiece", bos_id, eos_id, template, add_bos, special)
    raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model")


class _Added:
    def __init__(self, token_id: int, special: bool) -> None:
        self.id, self.special = token_id, special


def _added_tokens(path: Path) -> list[_Added]:
    data = json.loads(path.read_text())
    return [_Added(t["id"], bool(t.get("special"))) for t in data.get("added_tokens", [])]


def _post_processor_adds_bos(path: Path) -> bool:
    data = json.loads(path.read_text())
    post = data.get("post_processor") or {}
    single = post.get("single") or []
    return bool(single) and "SpecialToken" in single[0]


def _gguf_tokenizer(path: str) -> Tokenizer:
    from models.gguf_loader import field

    model = str(field(path, "tokenizer.ggml.model"))
    tokens = [str(t) for t in field(path, "tokenizer.ggml.tokens")]
    types = list(field(path, "tokenizer.ggml.token_type") or [1] * len(tokens))
    bos = field(path, "tokenizer.ggml.bos_token_id")
    eos = field(path, "tokenizer.ggml.eos_token_id")
    template = field(path, "tokenizer.chat_template")
    if model == "gpt2":
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in field(path, "tokenizer.ggml.merges")]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _bpe_pre_tokenizer(
            str(field(path, "tokenizer.ggml.pre", "default"))
        )
        backend.decoder = decoders.ByteLevel()
        default_add_bos = False
    elif model == "llama":
        scores = list(field(path, "tokenizer.ggml.scores"))
        unk = int(field(path, "tokenizer.ggml.unknown_token_id", 0))
        backend = HFTokenizer(
            models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk, byte_fallback=True)
        )
        prefix = bool(field(path, "tokenizer.ggml.add_space_prefix", True))
        norms = [normalizers.Prepend("▁")] if prefix else []
        backend.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", "▁")])
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if prefix else [])
        )
        default_add_bos = True
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}")
    special_ids = {i for i, t in enumerate(types) if t in _GGUF_SPECIAL_TYPES}
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(special_ids)]
    )
    add_bos = bool(field(path, "tokenizer.ggml.add_bos_token", default_add_bos))
    return Tokenizer(
        backend,
        "tokenizers",
        None if bos is None else int(bos),
        None if eos is None else int(eos),
        None if template is None else str(template),
        add_bos,
        special_ids,
    )


def _bpe_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # gpt2 and default
