"""From a step's update to what a caller sees: incremental text, stop strings, and the one
`RequestOutput` factory. Runs on the engine thread: the scheduler's one exit asks
`match_stop` where a stop string cuts a request's new tokens (so it ends before anything is
drafted from tokens that will be dropped), then `emit` turns the `StepUpdate` into outputs.
Nothing here ends a request."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.core.batch import StepUpdate
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.outputs import ClientFault, RequestOutput
from engine.core.request import Request
from engine.core.sampled import TokenLogprobs
from models.tokenizer import Tokenizer


def request_output(
    request: Request,
    tokens: list[int],
    text: str,
    logprobs: list[TokenLogprobs] | None = None,
    error: str | None = None,
    embedding: torch.Tensor | None = None,
) -> RequestOutput:
    finished = request.is_finished
    reason = request.finish_reason
    return RequestOutput(
        request.request_id,
        tokens,
        text,
        finished,
        reason.value if finished and reason is not None else None,
        request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        prefix_hit=request.prefix_hit,
        num_output_tokens=request.num_output_tokens,
        logprobs=logprobs or [],
        error=error,
        client_error=isinstance(error, ClientFault),
        queue_time=request.queue_time,
        prefill_time=request.prefill_time,
        embedding=embedding,
    )


class OutputProcessor:
    """Owns each request's detokenizer (none without a tokenizer: token ids only)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        export_kv: Callable[[Request], list[tuple[bytes, bytes]]],
    ) -> None:
        self.tokenizer = tokenizer
        # a finished request whose params ask for it carries its prompt's KV blocks out (P/D);
        # its blocks were freed this step but stay cached: nothing evicts them before the next
        # allocation
        self.export_kv = export_kv
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # requests scoring their prompt: the entries so far, by position (None: the first)
        self.prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self.num_finished = 0

    def add(self, request: Request) -> None:
        if request.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs[request.request_id] = [None] * request.num_prompt_tokens
        if self.tokenizer is None or request.sampling_params.pooling is not None:
            return  # no text to make (an embedding request returns a vector)
        params = request.sampling_params
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
        )

    def match_stop(self, request: Request, tokens: list[int]) -> tuple[int, str] | None:
        """Feed the request's new tokens to its detokenizer; where a stop string ends inside
        them: (how many tokens to keep, the string). Under speculation several tokens arrive
        at once."""
        detok = self.detokenizers.get(request.request_id)
        if detok is None:
            return None
        for j, token in enumerate(tokens):
            matched = detok.add([token])
            if matched is not None:
                return j + 1, matched
        return None

    def emit(self, update: StepUpdate) -> list[RequestOutput]:
        """The step's outputs: failures (with why), embeddings, and each sampling request's
        delta; prompt logprobs ride on a request's first output after its prefill."""
        outputs = [self.final_output(r, error=why) for r, why in update.failed]
        for request, first, entries in update.scored:
            held = self.prompt_logprobs.get(request.request_id)
            if held is not None:  # entries for the tokens at first + 1, first + 2, ...
                held[first + 1 : first + 1 + len(entries)] = entries
        outputs += [self.pooled_output(r, vector) for r, vector in update.pooled]
        outputs += [self.step_output(e.request, e.token_ids, e.logprobs) for e in update.emitted]
        return outputs

    def step_output(
        self, request: Request, tokens: list[int], logprobs: list[TokenLogprobs]
    ) -> RequestOutput:
        """The step's delta for a request whose tokens the scheduler has applied."""
        detok = self.detokenizers.get(request.request_id)
        text = detok.flush(request.is_finished) if detok is not None else ""
        out = request_output(request, tokens, text, logprobs)
        # the first output after the prefill carries the whole prompt's
        out.prompt_logprobs = self.prompt_logprobs.pop(request.request_id, None)
        if request.is_finished:
            self.detokenizers.pop(request.request_id, None)
            self.num_finished += 1
            if request.sampling_params.export_kv:
                out.kv_blocks = self.export_kv(request)
        return out

    def pooled_output(self, request: Request, embedding: torch.Tensor) -> RequestOutput:
        """The one output of an embedding request (finished): its pooled vector."""
        self.num_finished += 1
        return request_output(request, [], "", embedding=embedding)

    def final_output(self, request: Request, error: str | None = None) -> RequestOutput:
        """The last output of a request ended from outside the step (abort, failure): the text
        held back so far, unless it failed."""
        detok = self.detokenizers.pop(request.request_id, None)
        self.prompt_logprobs.pop(request.request_id, None)
        text = detok.flush(True) if detok is not None and error is None else ""
        return request_output(request, [], text, error=error)
