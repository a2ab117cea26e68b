"""Batched sampling over the logits rows of one step.

Order of processing (as vLLM and OpenAI document it): logit_bias, min_tokens (stop ids masked),
penalties (repetition on prompt+output; presence/frequency on output), then temperature, top_k,
top_p, min_p, and a draw. Greedy rows take the argmax of the processed logits.

Draws invert the row's cumulative distribution at one uniform (`inverse_cdf`): a seeded request
draws its uniform from its own generator, so its tokens do not depend on which other requests
share the batch. (The exponential race, argmax p / E with E ~ Exp(1), draws a whole vocabulary of
exponentials a row: ~1 ms for SmolLM2's 49,152 on a CPU, a fifth of a decode step.) Logprobs
are the model's raw log-softmax (before any processing), as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.core.sampled import SamplerOutput, TokenLogprobs
from engine.core.sampling_params import SamplingParams


class SamplingContext(Protocol):
    """What sampling reads of a request: a `Request`, or a view of one with draft tokens
    appended (speculative verification)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def generator(self) -> torch.Generator | None: ...


def _apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingContext]) -> None:
    rows = [i for i, r in enumerate(requests) if r.sampling_params.needs_penalties]
    if not rows:
        return
    vocab = logits.shape[1]
    for i in rows:  # per request: a vector op over the vocab each, not per token
        r, params = requests[i], requests[i].sampling_params
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(r.all_token_ids, device=logits.device).clamp_(0, vocab - 1).unique()
            vals = row[seen]
            rp = params.repetition_penalty
            row[seen] = torch.where(vals > 0, vals / rp, vals * rp)
        if params.presence_penalty or params.frequency_penalty:
            out = r.output_token_ids
            if out:
                counts = torch.bincount(
                    torch.tensor(out, device=logits.device).clamp_(0, vocab - 1), minlength=vocab
                ).to(row.dtype)
                row -= params.frequency_penalty * counts
                row -= params.presence_penalty * (counts > 0).to(row.dtype)


def _apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    truncate: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """`truncate` / `use_min_p`: whether any row has top_k/top_p / min_p, known on the host
    (asking the device tensors would cost a sync each)."""
    vocab = logits.shape[1]
    if truncate:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        cum_before = probs.cumsum(-1) - probs  # mass strictly above each token
        drop |= cum_before >= top_p[:, None]
        drop[:, 0] = False  # always keep the best token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if use_min_p:
        probs = logits.softmax(-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def apply_logits_processors(
    logits: torch.Tensor, requests: Sequence[SamplingContext]
) -> torch.Tensor:
    """logit_bias, min_tokens and penalties; returns `logits` itself when none apply."""
    params = [r.sampling_params for r in requests]
    if any(
        p.logit_bias or (p.min_tokens and r.num_output_tokens < p.min_tokens) or p.needs_penalties
        for p, r in zip(params, requests)
    ):
        logits = logits.clone()
        for i, (p, r) in enumerate(zip(params, requests)):
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()), device=logits.device)
                vals = torch.tensor(
                    list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device
                )
                logits[i].index_add_(0, ids, vals)
            if p.min_tokens and r.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
                if stops:
                    logits[i, list(stops)] = float("-inf")
        _apply_penalties(logits, requests)
    return logits


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, softmax: the distribution a (non-greedy) row draws
    from. Speculative verification applies the same to the target's and the draft's rows."""
    # one upload for the four per-row settings (float64 holds top_k exactly)
    table = torch.tensor(
        [[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], dtype=torch.float64
    ).to(logits.device)
    sub = _apply_top_k_top_p_min_p(
        logits / table[:, 0, None].to(logits.dtype),
        table[:, 1].long(),
        table[:, 2].to(logits.dtype),
        table[:, 3].to(logits.dtype),
        truncate=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        use_min_p=any(p.min_p > 0 for p in params),
    )
    return sub.softmax(-1)


def sample(logits: torch.Tensor, requests: Sequence[SamplingContext]) -> SamplerOutput:
    """logits: [len(requests), vocab] float32; row i belongs to requests[i]."""
    n = len(requests)
    params = [r.sampling_params for r in requests]
    want_logprobs = [p.logprobs is not None for p in params]
    raw_logprobs = logits.log_softmax(-1) if any(want_logprobs) else None
    logits = apply_logits_processors(logits, requests)

    token_ids = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = sampling_probs(logits.index_select(0, rows), [params[i] for i in sampled_rows])
        u = torch.empty(len(sampled_rows), dtype=torch.float64, device=probs.device)
        seeded = [j for j, i in enumerate(sampled_rows) if requests[i].generator is not None]
        if len(seeded) < len(sampled_rows):
            u.uniform_()
        for j in seeded:
            u[j : j + 1].uniform_(generator=requests[sampled_rows[j]].generator)
        token_ids[rows] = inverse_cdf(probs, u)

    # one read of the picks: a refused row comes back as REFUSED, not as a second sync
    ids = mark_refused(logits, token_ids).tolist()
    refused = [i for i, t in enumerate(ids) if t == REFUSED]
    logprobs: list[TokenLogprobs | None] = [None] * n
    if raw_logprobs is not None:
        for i, p in enumerate(params):
            if ids[i] != REFUSED:
                logprobs[i] = token_logprobs(raw_logprobs[i], ids[i], p.logprobs)
    return SamplerOutput(ids, logprobs, refused)


REFUSED = -1  # a row's pick where nothing was allowed: never a token id


def mark_refused(processed: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """`token_ids` with REFUSED where the pick is not an allowed token: out of the vocabulary
    (the inverse CDF of a row whose probabilities are all 0 or NaN answers the vocabulary size)
    or of logit -inf/NaN after every processor and mask (the argmax of a row of -inf is token
    0). A pick is allowed exactly when its processed logit is above -inf, so one gather checks
    every row, on the device: no token the constraints forbid ever leaves the sampler."""
    vocab = processed.shape[1]
    in_range = (token_ids >= 0) & (token_ids < vocab)
    picked = processed.gather(1, token_ids.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
    return torch.where(in_range & (picked > float("-inf")), token_ids, REFUSED)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token a row of `probs` [rows, vocab] (unnormalised is fine) for uniforms `u` [rows]
    in [0, 1): the first token whose cumulative probability exceeds u x the row's total (in
    float64), so a token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    # u x total can round up to the total itself: the largest value below it instead
    t = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, t.unsqueeze(-1), right=True).squeeze(-1)


def token_logprobs(row: torch.Tensor, token_id: int, top_n: int | None) -> TokenLogprobs | None:
    """The chosen token's logprob and the top-N alternatives from a raw log-softmax row."""
    if top_n is None:
        return None
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, idx = row.topk(top_n)
        top = list(zip(idx.tolist(), vals.tolist()))
    return TokenLogprobs(token_id, float(row[token_id]), top)
