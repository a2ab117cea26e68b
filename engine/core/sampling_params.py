"""Per-request sampling parameters, validated once at construction. Every error names the field
(`ValueError.param`) so the server can answer with an OpenAI-style `param`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


class ParamError(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_calls"]


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What an output must match (engine/grammar/structured_output.py compiles it). `source`: a JSON
    schema (JSON text), a regex, a JSON list of choices, an EBNF grammar, or (tool_calls)
    {"format", "parallel", "tools": [{name, parameters}]} as JSON; empty for json_object."""

    kind: GrammarKind
    source: str


@dataclass(frozen=True, slots=True)
class ThoughtBudget:
    """At most `tokens` tokens of thought. The thought runs from the output's start when the
    prompt opened it (`open_id` None), else from the model's `open_id` token; it ends at
    `close_id`, which is forced once the budget is spent."""

    tokens: int
    close_id: int
    open_id: int | None = None

    def must_close(self, output: list[int]) -> bool:
        """Whether the next token must end the thought, given the output so far."""
        start = 0
        if self.open_id is not None:
            if self.open_id not in output:
                return False
            start = output.index(self.open_id) + 1
        thought = output[start:]
        return self.close_id not in thought and len(thought) >= self.tokens


@dataclass(frozen=True, slots=True)
class KeepPrefix:
    """Keep the prompt's first `num_tokens` cached for `ttl_s` seconds after the request ends
    (Anthropic's `cache_control` breakpoints), pinned under `app`'s bounded share of the pool."""

    num_tokens: int
    ttl_s: float
    app: str = "default"


@dataclass(frozen=True, slots=True)
class LoRARef:
    """The LoRA adapter a request is served with (engine/lora/): its name, and the fingerprint
    of its weights, which keys its KV blocks apart from the base model's and every other
    adapter's (an adapter loaded again under the same name with other weights shares none)."""

    name: str
    key: str


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives; 0 = only the chosen token
    # score the prompt too: each prompt token's logprob given the tokens before it, with this
    # many alternatives (`RequestOutput.prompt_logprobs`); computed in the request's own
    # prefill, which then takes no prefix-cache hits (it needs every position's logits)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    grammar: GrammarSpec | None = None  # constrained decoding
    # "last" | "mean": an embedding request (prefill only; its output is the pooled hidden
    # state, engine/runner/pooling.py); None: generate
    pooling: str | None = None
    # disaggregation: when the request finishes, hand its prompt's full KV blocks back with
    # its last output (`RequestOutput.kv_blocks`), for the remote store
    export_kv: bool = False
    # a thinking model's thought, bounded: after this many tokens of thought its end token is
    # forced (`ThoughtBudget`); None: unbounded
    thought_budget: ThoughtBudget | None = None
    keep_prefix: KeepPrefix | None = None
    # the client reads tokens as they come: its decode rows bound the step's latency
    # (`max_itl_factor`, engine/core/step_budget.py)
    streamed: bool = False
    lora: LoRARef | None = None  # None: the base model

    @property
    def cache_namespace(self) -> str | None:
        """What keys the prompt's KV blocks beside its tokens (engine/kv/hashing.py): the cache
        salt, and the adapter's fingerprint where an adapter serves it."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora.key}"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 (off) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                "must be in [0, 20]",
            ),
            ("pooling", self.pooling in (None, "last", "mean"), "must be last or mean"),
            (
                "logit_bias",
                all(-100 <= v <= 100 for v in self.logit_bias.values()),
                "values must be in [-100, 100]",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise ParamError(param, f"{param} {message}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
