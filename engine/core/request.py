"""A request's state. The one invariant: `num_computed_tokens` (tokens whose KV is in the cache)
catches up with `num_tokens` (prompt + generated). A prefill chunk, a prefix-cache hit, a decode
step and a preemption (reset to 0) are all moves of that one counter."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.core.images import PromptImage
from engine.core.outputs import PrefixSummary
from engine.core.positions import RopePositions
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from engine.spec.draft_state import DraftState
    from models.lora import LoRAWeights


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_model_len: int
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # for the queue-time histogram
    # when its first token is due (the scheduler's prefill order, engine/core/step_budget.py)
    deadline: float = 0.0
    prefill_estimate: int = 0  # tokens its prefill needs, as the prefix cache stood at arrival
    first_token_time: float | None = None  # for the prefill-time histogram
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit when first admitted (any tier)
    prefix_hit: PrefixSummary | None = None  # the same by tier, and the evicted tokens after it
    lora: LoRAWeights | None = None  # the adapter its `sampling_params.lora` names, resolved
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # where the seeded generator lives: the engine's device (a CPU generator cannot draw into
    # CUDA tensors)
    device: torch.device | str = "cpu"
    block_hashes: list[bytes] = field(default_factory=list)
    # Speculation: draft tokens to verify next step (not part of all_token_ids), and for sampled
    # requests their draft distributions q [k, vocab].
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    drafts: DraftState | None = None  # which source drafts, and how well each did
    # constrained decoding: the grammar's state after this request's output tokens
    matcher: GrammarMatcher | None = None
    # mean pooling: float32 sum of the prompt positions' hidden states computed so far
    pooled_sum: torch.Tensor | None = None
    # the prompt's images, by position (engine/core/images.py)
    images: tuple[PromptImage, ...] = ()
    # its rotary positions where they are not its token indices (M-RoPE with images)
    rope_positions: RopePositions | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(
                self.sampling_params.seed
            )

    @property
    def num_spec(self) -> int:
        return len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token: the prompt's uncached part, computed in steps it
        shares with other requests' decodes and prefills."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.all_token_ids.append(token_id)

    def check_stop(self) -> FinishReason | None:
        """Token-level stop rules after a token was appended: why the request ends, if it does
        (a stop token is also recorded as `stop_reason`)."""
        params = self.sampling_params
        last = self.all_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
