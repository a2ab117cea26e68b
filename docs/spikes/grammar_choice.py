"""Grammar engine choice for constrained decoding on CPU: xgrammar vs llguidance.

For each library, over a 49k vocabulary (the default model SmolLM2-135M-Instruct's GGUF
tokenizer) and a Qwen2-size one (151,646 tokens, model vocab 151,936: a synthetic byte-level
BPE grown from the 49k one with CJK characters and word merges), it measures:

* compile: cold compile time of 10 typical grammars (7 JSON schemas, any-JSON object, a regex,
  a choice of 5 strings) with no cache; time to first mask (compile + matcher + first mask);
  the cost of a cache hit (same source again) and of a new per-request matcher from the cache;
* mask: per-step time to fill one bitmask row per constrained request for a batch of N
  matchers (mixed grammars, each stepped token by token through a tokenized valid output,
  restarting as a new request when done) through the library's batch API, plus the batched
  accept of the sampled tokens;
* apply: time to apply the [N, vocab/32] int32 bitmask to [N, model vocab] float32 logits;
* features: advance-then-rollback of speculative drafts (mask identical afterwards),
  rejection of a bad draft token, jump-forward, termination, special tokens inside strings.

    python docs/spikes/grammar_choice.py [--batch 64] [--steps 200] [--threads 2] [--reps 3]

Prints markdown tables. Needs, installed without pulling torch or triton:
`pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1`.
Not imported by tests.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance as llg
import llguidance.torch as llg_torch
import pydantic
import torch
import xgrammar as xgr
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from models.loader import default_model_path
from models.tokenizer import load_tokenizer

QWEN_TOKENIZER_VOCAB = 151_646  # Qwen2: 151,643 BPE tokens + 3 specials (here)
QWEN_MODEL_VOCAB = 151_936  # lm_head rows: 290 padding rows past the tokenizer

# ---- grammars --------------------------------------------------------------------------------


class _Item(pydantic.BaseModel):
    sku: str
    quantity: int = 1
    note: str | None = None


class _Order(pydantic.BaseModel):
    order_id: int
    customer: str
    email: str | None = None
    items: list[_Item]
    gift: bool = False
    discount: float | None = None


_S, _I, _N, _B = ({"type": t} for t in ("string", "integer", "number", "boolean"))


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props)}


@dataclass
class GrammarCase:
    name: str
    kind: str  # json_schema | json_object | regex | choice
    source: str  # schema JSON / regex / JSON list of choices
    instance: str  # a valid output


def grammar_cases() -> list[GrammarCase]:
    def schema(name: str, s: dict[str, Any], value: Any) -> GrammarCase:
        return GrammarCase(name, "json_schema", json.dumps(s), json.dumps(value))

    colors = ["red", "green", "blue", "cyan", "magenta", "yellow", "black", "white"]
    return [
        schema(
            "flat object (5 typed fields)",
            _obj({"name": _S, "age": _I, "email": _S, "active": _B, "score": _N}),
            {
                "name": "Ada Lovelace",
                "age": 36,
                "email": "ada@example.com",
                "active": True,
                "score": 97.5,
            },
        ),
        schema(
            "nested objects",
            _obj(
                {
                    "user": _obj(
                        {
                            "id": _I,
                            "profile": _obj(
                                {"first": _S, "last": _S, "tags": {"type": "array", "items": _S}}
                            ),
                        }
                    ),
                    "created_at": _S,
                }
            ),
            {
                "user": {
                    "id": 4211,
                    "profile": {
                        "first": "Grace",
                        "last": "Hopper",
                        "tags": ["navy", "cobol", "compilers"],
                    },
                },
                "created_at": "2024-05-01T12:00:00Z",
            },
        ),
        schema(
            "array of objects",
            _obj(
                {
                    "items": {
                        "type": "array",
                        "minItems": 1,
                        "items": _obj({"sku": _S, "qty": _I, "price": _N}),
                    }
                }
            ),
            {
                "items": [
                    {"sku": "A-100", "qty": 2, "price": 9.99},
                    {"sku": "B-220", "qty": 1, "price": 24.5},
                    {"sku": "C-310", "qty": 12, "price": 0.75},
                ]
            },
        ),
        schema(
            "enums",
            _obj(
                {
                    "status": {"enum": ["pending", "active", "suspended", "closed"]},
                    "priority": {"enum": ["low", "medium", "high", "critical"]},
                    "color": {"type": "string", "enum": colors},
                    "level": {"enum": [1, 2, 3, 5, 8]},
                }
            ),
            {"status": "active", "priority": "high", "color": "magenta", "level": 5},
        ),
        schema(
            "pydantic model, optional fields",
            _Order.model_json_schema(),
            {
                "order_id": 991,
                "customer": "Linus",
                "email": None,
                "items": [
                    {"sku": "KB-1", "quantity": 1, "note": "gift wrap"},
                    {"sku": "MS-2", "quantity": 2, "note": None},
                ],
                "gift": False,
                "discount": 0.1,
            },
        ),
        schema(
            "tool call {name: const, arguments}",
            _obj(
                {
                    "name": {"const": "get_weather"},
                    "arguments": _obj(
                        {
                            "city": _S,
                            "unit": {"enum": ["celsius", "fahrenheit"]},
                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                        },
                        ["city", "unit"],
                    ),
                }
            ),
            {
                "name": "get_weather",
                "arguments": {"city": "San Francisco", "unit": "celsius", "days": 3},
            },
        ),
        schema(
            "string constraints (pattern, length)",
            _obj(
                {
                    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "title": {"type": "string", "minLength": 3, "maxLength": 40},
                    "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                }
            ),
            {"code": "ABC-1234", "title": "Quarterly report", "count": 42},
        ),
        GrammarCase(
            "json_object (any JSON object)",
            "json_object",
            "",
            json.dumps(
                {
                    "answer": "Paris",
                    "confidence": 0.93,
                    "sources": ["wiki", "atlas"],
                    "meta": {"lang": "en", "tokens": 17},
                }
            ),
        ),
        GrammarCase("regex \\d{3}-\\d{4}", "regex", r"\d{3}-\d{4}", "555-1234"),
        GrammarCase(
            "choice of 5 strings",
            "choice",
            json.dumps(["positive", "negative", "neutral", "mixed", "unknown"]),
            "neutral",
        ),
    ]


# ---- tokenizers ------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@dataclass
class Vocab:
    label: str
    hf: HFTokenizer  # the `tokenizers.Tokenizer` (encode, to_str)
    eos: int
    special_ids: list[int]
    model_vocab: int  # logits width (>= tokenizer vocab; extra rows are padding)

    @property
    def tokenizer_vocab(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encoded_vocab(self) -> list[str]:
        vocab = [""] * self.tokenizer_vocab
        for tok, i in self.hf.get_vocab(with_added_tokens=True).items():
            vocab[i] = tok
        return vocab


def smollm_vocab() -> Vocab:
    tok = load_tokenizer(default_model_path())
    assert tok.eos_token_id is not None
    hf = tok._backend  # the rebuilt `tokenizers.Tokenizer` of the GGUF vocabulary
    return Vocab("49k SmolLM2", hf, tok.eos_token_id, sorted(tok.special_ids), tok.vocab_size)


def qwen_size_vocab(base: Vocab, seed: int = 0) -> Vocab:
    """Grow the 49k byte-level BPE to Qwen2's 151,646 tokens: ~21k CJK characters (with their
    2-byte prefixes) and random word/subword merges of existing tokens, each a valid BPE merge."""
    data = json.loads(base.hf.to_str())
    model = data["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merges: list[Any] = list(model["merges"])
    pair_as_list = bool(merges) and isinstance(merges[0], list)
    target = QWEN_TOKENIZER_VOCAB - 3

    def add(a: str, b: str) -> None:
        vocab[a + b] = len(vocab)
        merges.append([a, b] if pair_as_list else f"{a} {b}")

    b2u = _bytes_to_unicode()
    for u in b2u.values():
        if u not in vocab:
            vocab[u] = len(vocab)
    for cp in range(0x4E00, 0x4E00 + 21_000):
        b = chr(cp).encode()
        pre = b2u[b[0]] + b2u[b[1]]
        if pre not in vocab:
            add(b2u[b[0]], b2u[b[1]])
        if pre + b2u[b[2]] not in vocab:
            add(pre, b2u[b[2]])
    rng = random.Random(seed)
    words = [t for t in vocab if t.lstrip("Ġ").isalpha() and len(t) >= 2]
    tails = [t for t in words if not t.startswith("Ġ")]
    while len(vocab) < target:
        a, b = rng.choice(words), rng.choice(tails)
        if a + b not in vocab and len(a + b) <= 18:
            add(a, b)
            words.append(a + b)
    model["vocab"], model["merges"] = vocab, merges
    hf = HFTokenizer.from_str(json.dumps(data))
    extra = ["<|box_start|>", "<|box_end|>", "<|quad_start|>"]
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    special = sorted({*base.special_ids, *(hf.token_to_id(t) for t in extra)})
    assert hf.get_vocab_size(with_added_tokens=True) == QWEN_TOKENIZER_VOCAB
    return Vocab("152k Qwen2-size (synthetic)", hf, base.eos, special, QWEN_MODEL_VOCAB)


# ---- engines ---------------------------------------------------------------------------------


class Engine:
    """What the benchmark needs from a grammar library; one instance per vocabulary."""

    name = ""

    def compile(self, case: GrammarCase) -> Any: ...  # cold, no cache
    def compile_cached(self, case: GrammarCase) -> Any: ...  # through the library/user cache
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]: ...
    def accept_one(self, m: Any, token: int) -> bool: ...
    def rollback(self, m: Any, n: int) -> None: ...
    def try_drafts(self, m: Any, tokens: list[int]) -> int: ...  # accepted prefix length
    def jump_forward(self, m: Any) -> bytes: ...
    def completed(self, m: Any) -> bool: ...
    def terminated(self, m: Any) -> bool: ...
    def is_error(self, m: Any) -> bool:
        return False


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, v: Vocab, threads: int) -> None:
        t = time.perf_counter()
        self.info = self.tokenizer_info(v, blank_specials=True)
        self.setup_s = time.perf_counter() - t
        self.cold = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.cached = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    @staticmethod
    def tokenizer_info(v: Vocab, blank_specials: bool) -> xgr.TokenizerInfo:
        # xgrammar treats a token as special (never allowed by a grammar) only when its
        # encoded string is empty; otherwise "<|im_start|>" is plain text inside JSON strings
        vocab = v.encoded_vocab()
        if blank_specials:
            for i in v.special_ids:
                if i != v.eos:
                    vocab[i] = ""
        return xgr.TokenizerInfo(
            vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=v.model_vocab, stop_token_ids=[v.eos]
        )

    @staticmethod
    def _compile(c: xgr.GrammarCompiler, case: GrammarCase) -> xgr.CompiledGrammar:
        if case.kind == "json_schema":
            return c.compile_json_schema(case.source)
        if case.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if case.kind == "regex":
            return c.compile_regex(case.source)
        return c.compile_grammar("root ::= " + " | ".join(map(json.dumps, json.loads(case.source))))

    def compile(self, case: GrammarCase) -> Any:
        return self._compile(self.cold, case)

    def compile_cached(self, case: GrammarCase) -> Any:
        return self._compile(self.cached, case)

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def accept_one(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)

    def try_drafts(self, m: Any, tokens: list[int]) -> int:
        n = 0
        for t in tokens:  # a rejected token leaves the state unchanged
            if not m.accept_token(t):
                break
            n += 1
        return n

    def jump_forward(self, m: Any) -> bytes:
        return m.find_jump_forward_string().encode()

    def completed(self, m: Any) -> bool:
        return m.is_completed()

    def terminated(self, m: Any) -> bool:
        return m.is_terminated()


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, v: Vocab, threads: int) -> None:
        t = time.perf_counter()
        self.tok = llg.LLTokenizer(v.hf.to_str(), n_vocab=v.model_vocab, eos_token=v.eos)
        self.setup_s = time.perf_counter() - t
        self.executor = llg.LLExecutor(threads)
        self.cache: dict[tuple[str, str], llg.LLMatcher] = {}

    @staticmethod
    def _grammar(case: GrammarCase) -> str:
        if case.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(case.source)
        if case.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if case.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(case.source)
        return llg.grammar_from("choice", case.source)

    def compile(self, case: GrammarCase) -> Any:
        m = llg.LLMatcher(self.tok, self._grammar(case), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def compile_cached(self, case: GrammarCase) -> Any:
        # llguidance has no compiled-grammar cache: keep a template matcher per source (its
        # lexer states, built lazily, are copied along) and deep_copy it per request.
        key = (case.kind, case.source)
        if key not in self.cache:
            self.cache[key] = self.compile(case)
        return self.cache[key]

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def accept(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        return llg_torch.consume_token_par(self.executor, list(zip(matchers, tokens)))

    def accept_one(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)

    def try_drafts(self, m: Any, tokens: list[int]) -> int:
        return m.try_consume_tokens(tokens)  # stops before a bad token; no error state

    def jump_forward(self, m: Any) -> bytes:
        return m.compute_ff_bytes()

    def completed(self, m: Any) -> bool:
        return m.is_accepting()

    def terminated(self, m: Any) -> bool:
        return m.is_stopped()

    def is_error(self, m: Any) -> bool:
        return m.is_error()


# ---- measurements ----------------------------------------------------------------------------


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


@dataclass
class Result:
    engine: str
    vocab: str
    setup_s: float = 0.0
    compile_ms: dict[str, list[float]] = field(default_factory=dict)
    first_mask_ms: dict[str, list[float]] = field(default_factory=dict)
    cache_hit_ms: list[float] = field(default_factory=list)
    new_matcher_us: list[float] = field(default_factory=list)
    fill_ms: list[float] = field(default_factory=list)
    accept_ms: list[float] = field(default_factory=list)
    violations: int = 0
    requests_done: int = 0
    rollback_ok: int = 0
    rollback_cases: int = 0
    rollback_us: list[float] = field(default_factory=list)
    reject_ok: int = 0
    jump_forward: str = ""
    termination_ok: int = 0
    special_in_string: bool = False
    special_in_string_raw: bool | None = None
    error_after_bad_token: str = ""


def bench_compile(eng: Engine, v: Vocab, cases: list[GrammarCase], reps: int, r: Result) -> None:
    bm = torch.empty(xgr.get_bitmask_shape(1, v.model_vocab), dtype=torch.int32)
    for case in cases:
        for _ in range(reps):
            t = time.perf_counter()
            compiled = eng.compile(case)
            t1 = time.perf_counter()
            m = compiled if isinstance(eng, LLGuidance) else eng.matcher(compiled)
            eng.fill([m], bm)
            t2 = time.perf_counter()
            r.compile_ms.setdefault(case.name, []).append((t1 - t) * 1e3)
            r.first_mask_ms.setdefault(case.name, []).append((t2 - t) * 1e3)
        compiled = eng.compile_cached(case)
        eng.fill([eng.matcher(compiled)], bm)
        for _ in range(reps):
            dt, compiled = timed(lambda case=case: eng.compile_cached(case))
            r.cache_hit_ms.append(dt * 1e3)
            dt, _ = timed(lambda compiled=compiled: eng.matcher(compiled))
            r.new_matcher_us.append(dt * 1e6)


class StepRunner:
    """A batch of `batch` requests on one engine; `step()` fills the batch bitmask, checks the
    next token of each request against it and accepts the tokens (both batched, timed)."""

    def __init__(
        self, eng: Engine, v: Vocab, cases: list[GrammarCase], batch: int, r: Result
    ) -> None:
        self.eng, self.r, self.batch, self.cases = eng, r, batch, cases
        rng = random.Random(1)
        self.seqs = [v.hf.encode(c.instance, add_special_tokens=False).ids + [v.eos] for c in cases]
        self.compiled = [eng.compile_cached(c) for c in cases]
        self.slot_case = [i % len(cases) for i in range(batch)]
        self.matchers: list[Any] = []
        self.pos: list[int] = []
        for i in range(batch):  # staggered: each slot starts somewhere inside its output
            seq = self.seqs[self.slot_case[i]]
            m = eng.matcher(self.compiled[self.slot_case[i]])
            p = rng.randrange(len(seq))
            for t in seq[:p]:
                assert eng.accept_one(m, t), (eng.name, cases[self.slot_case[i]].name, t)
            self.matchers.append(m)
            self.pos.append(p)
        shape = xgr.get_bitmask_shape(batch, v.model_vocab)
        self.bitmask = torch.empty(shape, dtype=torch.int32)

    def step(self, record: bool) -> None:
        eng, r, ms = self.eng, self.r, self.matchers
        t0 = time.perf_counter()
        eng.fill(ms, self.bitmask)
        t1 = time.perf_counter()
        tokens = [self.seqs[self.slot_case[i]][self.pos[i]] for i in range(self.batch)]
        r.violations += sum(not allowed(self.bitmask, i, t) for i, t in enumerate(tokens))
        t2 = time.perf_counter()
        ok = eng.accept(ms, tokens)
        t3 = time.perf_counter()
        assert all(ok), (eng.name, [self.cases[self.slot_case[i]].name for i in range(len(ok))])
        if record:
            r.fill_ms.append((t1 - t0) * 1e3)
            r.accept_ms.append((t3 - t2) * 1e3)
        for i in range(self.batch):
            c = self.slot_case[i]
            self.pos[i] += 1
            if self.pos[i] == len(self.seqs[c]):  # EOS accepted: a new request takes the slot
                assert eng.terminated(ms[i])
                ms[i] = eng.matcher(self.compiled[c])
                self.pos[i] = 0
                r.requests_done += 1


def bench_features(eng: Engine, v: Vocab, cases: list[GrammarCase], r: Result) -> None:
    bm = torch.empty(xgr.get_bitmask_shape(2, v.model_vocab), dtype=torch.int32)
    for case in cases:
        seq = v.hf.encode(case.instance, add_special_tokens=False).ids
        compiled = eng.compile_cached(case)
        if case.kind == "json_schema" and case.name.startswith("tool call"):
            m = eng.matcher(compiled)
            for t in v.hf.encode('{"', add_special_tokens=False).ids:
                eng.accept_one(m, t)
            r.jump_forward = eng.jump_forward(m).decode(errors="replace")
        # termination: the whole output (complete), then EOS (terminated)
        m = eng.matcher(compiled)
        ok = all(eng.accept_one(m, t) for t in seq) and eng.completed(m)
        r.termination_ok += ok and eng.accept_one(m, v.eos) and eng.terminated(m)
        if len(seq) < 3:
            continue
        # speculative: advance k drafts, roll back k, the mask must be the one from before
        r.rollback_cases += 1
        p = len(seq) // 3
        k = min(4, len(seq) - p)
        m = eng.matcher(compiled)
        for t in seq[:p]:
            eng.accept_one(m, t)
        eng.fill([m], bm[0:1])
        n = eng.try_drafts(m, seq[p : p + k])
        dt, _ = timed(lambda m=m, n=n: eng.rollback(m, n))
        r.rollback_us.append(dt * 1e6)
        eng.fill([m], bm[1:2])
        r.rollback_ok += n == k and torch.equal(bm[0], bm[1])
        # rejection: drafts = valid prefix + a disallowed token; accept the prefix only
        eng.fill([m], bm[0:1])
        bad = next(
            t for t in range(v.tokenizer_vocab) if not allowed(bm, 0, t) and t not in v.special_ids
        )
        drafts = [seq[p], bad]
        n = eng.try_drafts(m, drafts)
        if n == 1:
            eng.rollback(m, 1)
            eng.fill([m], bm[1:2])
            r.reject_ok += (not eng.is_error(m)) and torch.equal(bm[0], bm[1])
    # a special token (<|im_start|>, id 1) inside a JSON string value
    m = eng.matcher(eng.compile_cached(cases[0]))
    for t in v.hf.encode('{"name": "Ada', add_special_tokens=False).ids:
        eng.accept_one(m, t)
    eng.fill([m], bm[0:1])
    r.special_in_string = allowed(bm, 0, 1)
    if isinstance(eng, XGrammar):  # the same check with the vocabulary as the tokenizer has it
        raw = xgr.GrammarCompiler(XGrammar.tokenizer_info(v, blank_specials=False))
        m2 = xgr.GrammarMatcher(XGrammar._compile(raw, cases[0]))
        for t in v.hf.encode('{"name": "Ada', add_special_tokens=False).ids:
            m2.accept_token(t)
        m2.fill_next_token_bitmask(bm, 1)
        r.special_in_string_raw = allowed(bm, 1, 1)
    # a disallowed token fed to the plain accept call
    bad = next(
        t for t in range(v.tokenizer_vocab) if not allowed(bm, 0, t) and t not in v.special_ids
    )
    eng.accept_one(m, bad)
    if eng.is_error(m):
        eng.rollback(m, 1)
        r.error_after_bad_token = "error state, sticky" if eng.is_error(m) else "error, cleared"
    else:
        r.error_after_bad_token = "returns False, state unchanged"


def bench_apply(v: Vocab, batch: int, bitmask: torch.Tensor, iters: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logits = torch.randn(batch, v.model_vocab)
    shifts = torch.arange(32, dtype=torch.int32)
    lut = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # byte -> 8 bits

    def eager(lg: torch.Tensor, bm: torch.Tensor) -> None:
        bits = ((bm.unsqueeze(-1) >> shifts) & 1).view(bm.shape[0], -1)[:, : lg.shape[1]]
        lg.masked_fill_(bits == 0, float("-inf"))

    def eager_lut(lg: torch.Tensor, bm: torch.Tensor) -> None:
        bits = lut[bm.view(torch.uint8).long()].view(bm.shape[0], -1)[:, : lg.shape[1]]
        lg.masked_fill_(~bits, float("-inf"))

    llg_apply = llg_torch.apply_token_bitmask_inplace
    impls: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "xgrammar.apply_token_bitmask_inplace (C++ CPU kernel)": xgr.apply_token_bitmask_inplace,
        "llguidance.torch.apply_token_bitmask_inplace (torch.compile)": llg_apply,
        "torch eager: shift-unpack + masked_fill_": eager,
        "torch eager: byte lookup table + masked_fill_": eager_lut,
    }
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    first: dict[str, float] = {}
    for name, fn in list(impls.items()):
        lg = logits.clone()
        try:
            first[name], _ = timed(lambda fn=fn, lg=lg: fn(lg, bitmask))
        except Exception as e:  # torch.compile needs a working C++ toolchain on CPU
            out[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
            del impls[name]
            continue
        out[name] = torch.equal(lg, ref)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(iters):  # interleaved: the machine is shared
        for name, fn in impls.items():
            lg = logits.clone()
            dt, _ = timed(lambda fn=fn, lg=lg: fn(lg, bitmask))
            times[name].append(dt * 1e3)
    for name, ts in times.items():
        out[name] = (statistics.mean(ts), pct(ts, 50), pct(ts, 99), first[name] * 1e3, out[name])
    return out


# ---- report ----------------------------------------------------------------------------------


def _f(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def report(
    args: argparse.Namespace,
    vocabs: list[Vocab],
    results: list[Result],
    applies: dict[str, dict[str, Any]],
    cases: list[GrammarCase],
    agree: dict[str, int],
) -> None:
    ver = {p: importlib.metadata.version(p) for p in ("xgrammar", "apache-tvm-ffi", "llguidance")}
    print("## Grammar engines on CPU: xgrammar vs llguidance\n")
    print(
        ", ".join(f"{p} {x}" for p, x in ver.items()) + f", torch {torch.__version__}; "
        f"batch {args.batch}, {args.threads} threads, {args.steps} steps, "
        f"{args.reps} cold compiles per grammar.\n"
    )
    print("| vocabulary | tokenizer vocab | model vocab (logits) | bitmask row (int32) |")
    print("|---|---:|---:|---:|")
    for v in vocabs:
        print(
            f"| {v.label} | {v.tokenizer_vocab:,} | {v.model_vocab:,} | "
            f"{(v.model_vocab + 31) // 32:,} |"
        )
    print("\n### Compile (ms; p50 / p99 over all grammars x reps)\n")
    print(
        "| engine | vocab | tokenizer setup | cold compile p50 | p99 | max | "
        "compile+matcher+1st mask p50 | p99 | cache hit p50 | new matcher from cache (us) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        c = [x for xs in r.compile_ms.values() for x in xs]
        f = [x for xs in r.first_mask_ms.values() for x in xs]
        print(
            f"| {r.engine} | {r.vocab} | {r.setup_s * 1e3:.0f} | {_f(pct(c, 50))} | "
            f"{_f(pct(c, 99))} | {_f(max(c))} | {_f(pct(f, 50))} | {_f(pct(f, 99))} | "
            f"{_f(pct(r.cache_hit_ms, 50))} | {_f(pct(r.new_matcher_us, 50))} |"
        )
    print("\n### Cold compile + matcher + first mask per grammar (ms, median of reps)\n")
    print("| grammar | " + " | ".join(f"{r.engine} {r.vocab.split()[0]}" for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    for case in cases:
        cells = [_f(statistics.median(r.first_mask_ms[case.name])) for r in results]
        print(f"| {case.name} | " + " | ".join(cells) + " |")
    print(f"\n### Per-step batch mask fill, batch {args.batch} (ms per step, whole batch)\n")
    print(
        "| engine | vocab | fill mean | fill p50 | fill p99 | batched accept mean | "
        "requests finished | sampled tokens outside mask |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.engine} | {r.vocab} | {_f(statistics.mean(r.fill_ms))} | "
            f"{_f(pct(r.fill_ms, 50))} | {_f(pct(r.fill_ms, 99))} | "
            f"{_f(statistics.mean(r.accept_ms))} | {r.requests_done} | {r.violations} |"
        )
    rows = (args.steps + 5) * args.batch
    print(
        "\nSame requests at the same positions in both engines; bitmask rows identical between "
        "them (same int32 layout, bit i of word j = token 32j+i): "
        + ", ".join(f"{k} {n}/{rows} ({100 * n / rows:.0f}%)" for k, n in agree.items())
    )
    print(f"\n### Apply bitmask to [{args.batch}, model vocab] float32 logits (ms)\n")
    print("| implementation | vocab | mean | p50 | p99 | first call | same result as xgrammar |")
    print("|---|---|---:|---:|---:|---:|---|")
    for label, rows in applies.items():
        for name, val in rows.items():
            if isinstance(val, str):
                print(f"| {name} | {label} | {val} | | | | |")
            else:
                mean, p50, p99, first, same = val
                print(
                    f"| {name} | {label} | {_f(mean)} | {_f(p50)} | {_f(p99)} | {_f(first)} "
                    f"| {same} |"
                )
    print("\n### Speculative decoding, termination, jump-forward\n")
    print(
        "| engine | vocab | advance k then rollback k: mask identical | rollback (us) | "
        "bad draft rejected, prefix kept | termination (complete, then EOS) | "
        "bad token via accept | <\\|im_start\\|> allowed inside a string | "
        'jump-forward after `{"` of the tool call |'
    )
    print("|---|---|---|---:|---|---|---|---|---|")
    for r in results:
        jf = r.jump_forward.replace("|", "\\|")
        special = str(r.special_in_string)
        if r.special_in_string_raw is not None:
            special += f" (specials blanked; {r.special_in_string_raw} with the raw vocab)"
        print(
            f"| {r.engine} | {r.vocab} | {r.rollback_ok}/{r.rollback_cases} | "
            f"{_f(statistics.mean(r.rollback_us))} | {r.reject_ok}/{r.rollback_cases} | "
            f"{r.termination_ok}/{len(cases)} | {r.error_after_bad_token} | "
            f"{special} | `{jf}` |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="cold compiles per grammar")
    ap.add_argument("--apply-iters", type=int, default=20)
    ap.add_argument("--only-49k", action="store_true", help="skip the 152k vocabulary")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = grammar_cases()
    small = smollm_vocab()
    vocabs = [small] if args.only_49k else [small, qwen_size_vocab(small)]
    results: list[Result] = []
    applies: dict[str, dict[str, Any]] = {}
    agree: dict[str, int] = {}  # bitmask rows identical between the two engines, all steps
    for v in vocabs:
        runners = []
        for cls in (XGrammar, LLGuidance):
            eng: Engine = cls(v, args.threads)
            r = Result(eng.name, v.label, setup_s=eng.setup_s)  # type: ignore[attr-defined]
            print(f"# {eng.name} / {v.label}: compile, features", file=sys.stderr, flush=True)
            bench_compile(eng, v, cases, args.reps, r)
            bench_features(eng, v, cases, r)
            runners.append(StepRunner(eng, v, cases, args.batch, r))
            results.append(r)
        print(f"# {v.label}: batch steps, apply", file=sys.stderr, flush=True)
        for step in range(args.steps + 5):  # engines interleaved: the machine is shared
            for runner in runners if step % 2 else runners[::-1]:
                runner.step(record=step >= 5)  # the first steps warm caches
            same = (runners[0].bitmask == runners[1].bitmask).all(dim=1).sum().item()
            agree[v.label] = agree.get(v.label, 0) + int(same)
        applies[v.label] = bench_apply(v, args.batch, runners[0].bitmask, args.apply_iters)
    report(args, vocabs, results, applies, cases, agree)


if __name__ == "__main__":
    main()
