"""The lossless verification of draft tokens, whatever drafted them: greedy rows keep drafts while
they equal the target's argmax; sampled rows follow Leviathan et al.'s rule (keep d with
probability min(1, p(d)/q(d)), else sample the residual), plus the bonus token. A leaf of the
engine's request core: runner outputs call it, and it knows only requests and sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Request
from engine.core.sampled import SamplerOutput, TokenLogprobs
from engine.core.sampling_params import SamplingParams
from engine.runner.sampler import (
    REFUSED,
    apply_logits_processors,
    mark_refused,
    sampling_probs,
    token_logprobs,
)


@dataclass(slots=True)
class DraftedRow:
    """A request as sampling sees it at verification row j: its tokens plus drafts d_1..d_j."""

    request: Request
    extra: list[int]

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.extra)

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.extra

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator


def verify(logits: torch.Tensor, requests: list[Request]) -> list[SamplerOutput]:
    """logits: the target's rows for each request's [last token, d_1..d_k] (k = its number of
    `spec_token_ids`), concatenated in request order. Returns the emitted tokens per request."""
    views = [DraftedRow(r, r.spec_token_ids[:j]) for r in requests for j in range(r.num_spec + 1)]
    want_lp = any(r.sampling_params.logprobs is not None for r in requests)
    raw = logits.log_softmax(-1) if want_lp else None
    processed = apply_logits_processors(logits, views)
    results, row = [], 0
    for r in requests:
        k, params = r.num_spec, r.sampling_params
        rows = processed[row : row + k + 1]
        if params.greedy:
            target = rows.argmax(-1).tolist()
            m = 0
            while m < k and r.spec_token_ids[m] == target[m]:
                m += 1
            tokens: list[int] | None = r.spec_token_ids[:m] + [target[m]]
        else:
            tokens = _rejection_sample(r, sampling_probs(rows, [params] * (k + 1)))
        # token j came from processed row j: the sampler's own check of each pick
        if (
            tokens is None
            or REFUSED
            in mark_refused(rows[: len(tokens)], torch.tensor(tokens, device=rows.device)).tolist()
        ):
            # the row that picks the last token allows nothing (a draft is always allowed by
            # the row before it, or verification rejected it): the request ends here
            results.append(SamplerOutput([], [], refused=[0]))
            row += k + 1
            continue
        lps: list[TokenLogprobs | None] = [None] * len(tokens)
        if raw is not None and params.logprobs is not None:
            lps = [token_logprobs(raw[row + j], t, params.logprobs) for j, t in enumerate(tokens)]
        results.append(SamplerOutput(tokens, lps))
        row += k + 1
    return results


def _rejection_sample(r: Request, p: torch.Tensor) -> list[int] | None:
    """Leviathan et al.'s rule over draft tokens drawn from r.spec_probs (q); without q the
    drafts were chosen deterministically (q one-hot at the draft): d is kept with probability
    p(d), else the token is drawn from p without d. None when a row it reads holds no
    probability (everything masked, or NaN): there is nothing to draw."""
    q, gen = r.spec_probs, r.generator
    valid = (p.isfinite().all(-1) & (p.sum(-1) > 0)).tolist()
    # drawn where p and the generator live (the engine's device), then read once
    uniforms = torch.rand(r.num_spec, generator=gen, device=p.device).tolist() if r.num_spec else []
    tokens: list[int] = []
    for j, d in enumerate(r.spec_token_ids):
        if not valid[j]:
            return None
        pj, qj = float(p[j, d]), (float(q[j, d]) if q is not None else 1.0)
        if uniforms[j] * qj < pj:  # P(u < p/q) = p/q exactly for u in [0, 1)
            tokens.append(d)
            continue
        if q is not None:
            residual = (p[j] - q[j]).clamp_(min=0)
        else:
            residual = p[j].clone()
            residual[d] = 0
        if float(residual.sum()) <= 0:
            residual = p[j]
        tokens.append(int(torch.multinomial(residual, 1, generator=gen)))
        return tokens
    if not valid[r.num_spec]:
        return None
    tokens.append(int(torch.multinomial(p[r.num_spec], 1, generator=gen)))
    return tokens
