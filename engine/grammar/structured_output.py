"""Constrained decoding with xgrammar: grammars compiled once per source (xgrammar's cache), one
matcher per request, one bitmask row per constrained row per step filled for the whole batch.

Chosen over llguidance by measurement (docs/spikes/grammar_choice.py): at batch 64 xgrammar
fills the masks 2-5x faster per step with a ~10x tighter p99, accepts and rolls back in batches,
and leaves a matcher unchanged when a token is refused (speculative drafts); llguidance compiles
faster, but compiled grammars are cached by source here, so that cost is paid once per schema.

xgrammar treats a token as special (never text) only when its vocabulary string is empty, so
the tokenizer's special tokens are blanked; the stop tokens are the engine's EOS ids. Rows past
the tokenizer's vocabulary (padding in the lm_head) stay masked. xgrammar's JSON strings admit raw
control characters in length-bounded strings, and UTF-8-encoded surrogates everywhere, which JSON
forbids (RFC 8259) and Python decodes as U+FFFD (breaking maxLength): JSON grammars are compiled
from xgrammar's own EBNF with those string character classes tightened.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from engine.core.batch import GrammarMask, ScheduledRequest, logits_spans
from engine.core.request import Request
from engine.core.sampling_params import GrammarSpec, ParamError
from engine.grammar.object_properties import balance_object_properties
from engine.grammar.token_bitmask import apply_bitmask

if TYPE_CHECKING:
    import xgrammar as xgr

    from models.tokenizer import Tokenizer

log = logging.getLogger("kvserve.structured")

__all__ = ["GrammarSpec", "StructuredOutputs"]


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _compact_json(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural tag's content: JSON following `schema` in the compact canonical form (no
    optional whitespace: a small model spends no tokens on indentation, and clients that
    compare arguments get one spelling): the grammar a response_format schema compiles to."""
    spec = GrammarSpec("json_schema", json.dumps(schema))  # the schema's own key order
    return {"type": "grammar", "grammar": grammar_source(spec)}


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a tool-call format spells calls (server/flow/tool_parsers.py reads them back): each call
    `begin` (with the name) + arguments + `end`, calls joined by `separator`, the whole list
    inside `opening` ... `closing`; `trigger` starts a call in free text."""

    begin: str  # %s: the JSON-quoted name
    end: str
    separator: str
    trigger: str
    opening: str = ""
    closing: str = ""
    gemma: bool = False  # Gemma 4's spelling: the name bare, the arguments `gemma_args`


CALL_FORMATS = {
    "hermes": CallFormat(
        '<tool_call>\n{"name": %s, "arguments": ', "}\n</tool_call>", "\n", "<tool_call>"
    ),
    "llama3_json": CallFormat('{"name": %s, "parameters": ', "}", "; ", '{"name": '),
    "mistral": CallFormat(
        '{"name": %s, "arguments": ', "}", ", ", "[TOOL_CALLS]", "[TOOL_CALLS] [", "]"
    ),
    "phi4_mini_json": CallFormat(
        '{"name": %s, "arguments": ', "}", ", ", "functools[", "functools[", "]"
    ),
    "gemma4": CallFormat("<|tool_call>call:%s", "<tool_call|>", "", "<|tool_call>", gemma=True),
}

_GEMMA_QUOTE = '"<|\\"|>"'  # the EBNF literal of Gemma 4's string mark <|"|>


def gemma_args(ebnf: str) -> str:
    """A compact-JSON grammar respelled as Gemma 4 writes arguments: identifier keys bare,
    strings between `<|"|>` marks (their text without `<`, so no mark is begun inside),
    no spaces after `,` and `:`. Other keys are `<|"|>` strings, which the parser reads too."""
    ebnf = re.sub(r'"\\"([A-Za-z_][A-Za-z0-9_]*)\\"" ": "', r'"\1:"', ebnf)
    ebnf = re.sub(r'"\\"((?:[^"\\]|\\.)*?)\\""', r'"<|\\"|>\1<|\\"|>"', ebnf)
    ebnf = ebnf.replace('"\\""', _GEMMA_QUOTE).replace('", "', '","').replace('": "', '":"')
    return ebnf.replace(_STRICT_CHARS, _GEMMA_CHARS)


def _tool_calls_tag(source: str) -> dict[str, Any]:
    """Calls in the request's tool-call format (`CALL_FORMATS`), each name one of the tools'
    and its arguments following its parameters schema in compact JSON; one unless parallel,
    and the turn ends after the last. "forced": only calls, at least one; "free" (tool_choice
    auto with strict tools): any text, and whatever follows the format's trigger is such a
    call (one per trigger). With an `answer` schema (response_format beside the tools): calls,
    or one answer in that format."""
    spec = json.loads(source)
    fmt = CALL_FORMATS[spec.get("format", "hermes")]
    answer = spec.get("answer")
    free = spec.get("mode", "forced") == "free" and answer is None

    def tag(t: dict[str, Any], wrap: bool) -> dict[str, Any]:
        begin = fmt.begin % (t["name"] if fmt.gemma else json.dumps(t["name"]))
        end = fmt.end
        if wrap:  # a free-text call carries the list's own markers
            begin, end = fmt.opening + begin, end + fmt.closing
        content = _compact_json(t["parameters"])
        if fmt.gemma:
            content["grammar"] = gemma_args(content["grammar"])
        return {"type": "tag", "begin": begin, "content": content, "end": end}

    if free:
        tags = [tag(t, wrap=True) for t in spec["tools"]]
        calls = {
            "type": "triggered_tags",
            "triggers": [fmt.trigger],
            "at_least_one": False,
            "tags": tags,
            "stop_after_first": not spec["parallel"],
        }
        return {"type": "structural_tag", "format": calls}
    calls = {
        "type": "tags_with_separator",
        "separator": fmt.separator,
        "at_least_one": True,
        "tags": [tag(t, wrap=False) for t in spec["tools"]],
        "stop_after_first": not spec["parallel"],
    }
    if fmt.opening or fmt.closing:
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": fmt.opening},
                calls,
                {"type": "const_string", "value": fmt.closing},
            ],
        }
    if answer is not None:
        calls = {"type": "or", "elements": [calls, _compact_json(answer)]}
    return {"type": "structural_tag", "format": calls}


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    import xgrammar as xgr

    n = tokenizer.vocab_size
    vocab = [tokenizer.id_to_token(i) or "" for i in range(n)]
    for i in tokenizer.special_ids:
        if i < n:
            vocab[i] = ""
    if tokenizer.kind == "sentencepiece":
        vocab_type = xgr.VocabType.BYTE_FALLBACK
    else:
        decoder = json.loads(tokenizer._backend.to_str()).get("decoder") or {}
        kinds = json.dumps(decoder)
        if '"ByteLevel"' in kinds:
            vocab_type = xgr.VocabType.BYTE_LEVEL
        elif '"ByteFallback"' in kinds:
            vocab_type = xgr.VocabType.BYTE_FALLBACK
        else:
            vocab_type = xgr.VocabType.RAW
    return xgr.TokenizerInfo(
        vocab, vocab_type, vocab_size=max(vocab_size, n), stop_token_ids=stop_ids
    )


# xgrammar's JSON string characters, and the same without control characters and surrogates
_LOOSE_CHARS = (r"[^\0-\x1f\"\\\r\n]", r"[^\"\\\r\n]")
_STRICT_CHARS = r"[^\0-\x1f\"\\\ud800-\udfff]"
_GEMMA_CHARS = r"[^\0-\x1f<\\\ud800-\udfff]"


@lru_cache(maxsize=1024)
def grammar_source(spec: GrammarSpec) -> str:
    """The EBNF an xgrammar matcher for `spec` compiles from (not for regexes)."""
    import xgrammar as xgr

    if spec.kind == "choice":
        return _choice_ebnf(json.loads(spec.source))
    if spec.kind == "grammar":
        return spec.source
    if spec.kind == "tool_calls":
        grammar = xgr.Grammar.from_structural_tag(json.dumps(_tool_calls_tag(spec.source)))
    else:
        schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    text = balance_object_properties(str(grammar))
    for loose in _LOOSE_CHARS:
        text = text.replace(loose, _STRICT_CHARS)
    return text


class StructuredOutputs:
    """The engine's grammar machinery. `compile` is thread-safe (the server validates and warms
    grammars off the engine thread); matchers and bitmasks belong to the engine thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.vocab_size = vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_limit_bytes=256 * 2**20)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)
        self._bitmask = xgr.allocate_token_bitmask(64, vocab_size)
        self._warm_up()

    def _warm_up(self) -> None:
        """What the first constrained request would otherwise pay: the bitmask op's build (a
        C++ compile on a fresh machine) and the first compile, fill and masking. A vocabulary
        that cannot spell JSON (the benches' word-level ones) warms up on a regex instead: its
        JSON requests get their 400 when they come."""
        try:
            matcher = self.matcher(GrammarSpec("json_object", ""))
        except ParamError:
            matcher = self.matcher(GrammarSpec("regex", ".*"))
        logits = torch.zeros(1, self.vocab_size)
        self.mask_logits(logits, [0], [matcher])

    def compile(self, spec: GrammarSpec, param: str = "structured_outputs") -> xgr.CompiledGrammar:
        """The compiled grammar (cached by source); ParamError naming `param` if it cannot be."""
        return self.compile_with(self.compiler, spec, param)

    def compile_with(
        self, compiler: xgr.GrammarCompiler, spec: GrammarSpec, param: str = "structured_outputs"
    ) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "regex":
                compiled = compiler.compile_regex(spec.source)
            else:
                compiled = compiler.compile_grammar(grammar_source(spec))
        except Exception as e:  # noqa: BLE001 - the library's errors are many types
            raise ParamError(param, f"{param}: cannot compile this {spec.kind}: {e}") from None
        self._refuse_empty(compiled, spec, param)
        return compiled

    def _refuse_empty(self, compiled: xgr.CompiledGrammar, spec: GrammarSpec, param: str) -> None:
        """A grammar that allows no first token (`root ::= root`, or text no token spells) has
        nothing to generate: refused here, where the client gets a 400, rather than at its first
        step. (An empty language that only shows later ends its request at that step.)"""
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise ParamError(
                param,
                f"{param}: this {spec.kind} admits no token: its language is empty "
                "(or spelled by no token of this model's vocabulary)",
            )

    def matcher(self, spec: GrammarSpec) -> xgr.GrammarMatcher:
        return self.xgr.GrammarMatcher(self.compile(spec))

    def fill(self, matchers: list[xgr.GrammarMatcher]) -> torch.Tensor:
        """One bitmask row per matcher (row i: what matchers[i] allows next)."""
        if len(matchers) > self._bitmask.shape[0]:
            self._bitmask = self.xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[: len(matchers)]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask

    def step_mask(self, scheduled: list[ScheduledRequest]) -> GrammarMask | None:
        """The bitmask rows of a step's constrained logits rows (None when none is). A drafted
        request's row j is masked at the state after its drafts d_1..d_j; a draft the grammar
        refuses ends its rows (the verifier rejects it), and the matcher is rolled back after."""
        plain_rows, plain = [], []
        drafted_rows: list[int] = []
        drafted: list[torch.Tensor] = []
        for s, start, _ in logits_spans(scheduled):
            m = s.request.matcher
            if m is None:
                continue
            if not s.num_spec:
                plain_rows.append(start)
                plain.append(m)
                continue
            drafted_rows.append(start)
            drafted.append(self.fill([m]).clone())
            accepted = 0
            for j, token in enumerate(s.request.spec_token_ids):
                if m.is_terminated() or not m.accept_token(token):
                    break
                accepted += 1
                if not m.is_terminated():  # past the grammar's end: the verifier stops there
                    drafted_rows.append(start + j + 1)
                    drafted.append(self.fill([m]).clone())
            if accepted:
                m.rollback(accepted)
        if not plain_rows and not drafted_rows:
            return None
        parts = ([self.fill(plain)] if plain else []) + drafted
        bitmask = parts[0] if len(parts) == 1 else torch.cat(parts)
        return GrammarMask(bitmask, plain_rows + drafted_rows)

    @torch.inference_mode()
    def mask_logits(
        self, logits: torch.Tensor, rows: list[int], matchers: list[xgr.GrammarMatcher]
    ) -> None:
        """logits[rows[i]] keeps only what matchers[i] allows (in place)."""
        if rows:
            apply_bitmask(logits, self.fill(matchers), rows)

    def advance(self, request: Request, tokens: list[int]) -> bool:
        """A constrained request's grammar takes the tokens it emitted this step; True when the
        grammar has reached its end (the request ends, even under ignore_eos)."""
        m = request.matcher
        if m is None:
            return False
        for token in tokens:
            if m.is_terminated():
                break
            if not m.accept_token(token):
                log.error("request %s: grammar refused sampled token %d", request.request_id, token)
                break
        return m.is_terminated()
