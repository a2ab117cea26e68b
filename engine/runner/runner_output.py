"""What one step's forward yields per request, made from its logits and hidden states: sampled
tokens (or verified drafts), pooled embeddings, and the requests that failed alone (non-finite
logits or hidden states, a sampler error). Pure functions of the step's tensors and its
`SchedulerOutput`; the runner calls them, the engine reads the `RunnerOutput`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionStep
from engine.core.batch import GrammarMask, ScheduledRequest, logits_spans
from engine.core.outputs import ClientFault
from engine.core.request import Request
from engine.core.sampled import SamplerOutput, TokenLogprobs
from engine.grammar.token_bitmask import apply_bitmask
from engine.runner.pooling import normalize
from engine.runner.sampler import sample
from engine.spec.verify import verify

log = logging.getLogger("kvserve.engine")
# why a request ends when its constraints leave no token to pick: a client's error, not the
# server's (a grammar whose language ran out, a logit_bias of -inf on every allowed token)
NOTHING_ALLOWED = ClientFault(
    "no token is allowed at this step: the request's grammar, logit_bias and min_tokens "
    "together exclude every token"
)


@dataclass(slots=True)
class RunnerOutput:
    """One step's results. `sampled`: each sampling request's tokens (one, or its accepted
    drafts plus the target's own token); `pooled`: embedding requests whose prefill ended, with
    their normalised vectors (float32, CPU); `scored`: the prompt logprobs this step's chunks
    computed, for requests that score their prompt; `failed`: requests that failed alone, with why;
    `hidden`: every scheduled token's hidden state (the draft head's features), None when the
    forward itself failed; `plan`: the forward's positions and attention plan (None for a CUDA
    graph's, which lives in its own buffers), which the draft head's catch-up reuses when it
    covers exactly the step's tokens."""

    sampled: list[tuple[ScheduledRequest, SamplerOutput]] = field(default_factory=list)
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)
    # (request, first position, prompt logprobs of the tokens after it) per scoring chunk
    scored: list[tuple[Request, int, list[TokenLogprobs]]] = field(default_factory=list)
    failed: list[tuple[Request, str]] = field(default_factory=list)
    forward_failed: bool = False  # the forward itself raised: `failed` holds every request
    hidden: torch.Tensor | None = None
    plan: tuple[torch.Tensor, AttentionStep] | None = None


def pool(
    hidden: torch.Tensor, scheduled: list[ScheduledRequest], width: int, into: RunnerOutput
) -> None:
    """Embedding requests (engine/runner/pooling.py): mean pooling adds this chunk's hidden rows to
    the request's running sum; a chunk that ends the prefill yields the pooled, normalised vector.
    `width`: the final-normed hidden state's (not EAGLE-3's aux features). A non-finite vector
    fails its request alone."""
    ends: list[tuple[Request, torch.Tensor]] = []
    row = 0
    for s in scheduled:
        r, n = s.request, s.num_new_tokens
        mode = r.sampling_params.pooling
        if mode == "mean":
            chunk = hidden[row : row + n, :width].float().sum(dim=0)
            r.pooled_sum = chunk if r.pooled_sum is None else r.pooled_sum + chunk
            if s.pools:
                ends.append((r, r.pooled_sum / r.num_prompt_tokens))
        elif mode == "last" and s.pools:
            ends.append((r, hidden[row + n - 1, :width]))
        row += n
    if not ends:
        return
    vectors = normalize(torch.stack([v for _, v in ends])).cpu()
    finite = vectors.isfinite().all(dim=-1).tolist()
    for (r, _), vector, ok in zip(ends, vectors, finite):
        r.pooled_sum = None
        if ok:
            into.pooled.append((r, vector))
        else:
            log.error("request %s: non-finite hidden state; failing it", r.request_id)
            into.failed.append((r, "the model produced a NaN/inf hidden state"))


def score_prompts(
    hidden: torch.Tensor,
    scheduled: list[ScheduledRequest],
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    into: RunnerOutput,
) -> None:
    """Requests with `prompt_logprobs`: each chunk position p whose next token is a prompt
    token gives that token's logprob and the top alternatives. Positions are as scheduled
    (`num_computed_tokens` before the step's update); a recomputed chunk gives them again."""
    row = 0
    for s in scheduled:
        r, n = s.request, s.num_new_tokens
        top = r.sampling_params.prompt_logprobs
        start = r.num_computed_tokens
        end = min(start + n, r.num_prompt_tokens - 1)  # the last prompt row samples instead
        if top is not None and end > start:
            lp = logits_of(hidden[row : row + end - start]).log_softmax(-1)
            following = r.prompt_token_ids[start + 1 : end + 1]
            index = torch.tensor(following, device=lp.device)[:, None]
            chosen = lp.gather(1, index)[:, 0].tolist()
            alternatives: list[list[tuple[int, float]]] = [[] for _ in chosen]
            if top > 0:
                values, indices = lp.topk(top, dim=-1)
                alternatives = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
            entries = [TokenLogprobs(*e) for e in zip(following, chosen, alternatives, strict=True)]
            into.scored.append((r, start, entries))
        row += n


def close_spent_thoughts(
    logits: torch.Tensor, spans: list[tuple[ScheduledRequest, int, int]]
) -> torch.Tensor:
    """A request whose thought has spent its budget samples the end of the thought: its row
    allows that token only (such requests are not drafted for, so the row is their only one)."""
    forced = []
    for s, a, _ in spans:
        budget = s.request.sampling_params.thought_budget
        if budget is not None and budget.must_close(s.request.output_token_ids):
            forced.append((a, budget.close_id))
    if not forced:
        return logits
    logits = logits.clone()  # the forward's own tensor is an inference tensor
    for row, token in forced:
        logits[row].fill_(float("-inf"))
        logits[row, token] = 0.0
    return logits


def sample_step(
    logits: torch.Tensor,
    scheduled: list[ScheduledRequest],
    grammar: GrammarMask | None,
    into: RunnerOutput,
) -> None:
    """Mask, then sample plain rows and verify drafted ones. A sampler error in the batched call
    samples the requests one by one, so that only the one that raises again fails."""
    spans = logits_spans(scheduled)
    if grammar is not None:  # in place (rows of this step's own tensor, made row-contiguous)
        logits = logits.contiguous()
        apply_bitmask(logits, grammar.bitmask, grammar.rows)
    logits = close_spent_thoughts(logits, spans)
    try:
        _sample(logits, spans, into)
    except Exception:  # a sampling bug must not kill the engine thread: isolate it
        log.exception("sampling failed; sampling the batch's requests one by one")
        failed = {id(r) for r, _ in into.failed}
        for s, a, b in spans:
            if id(s.request) in failed:  # failed in the batched call already
                continue
            try:
                _sample(logits[a:b], [(s, 0, b - a)], into)
            except Exception:
                log.exception("request %s: sampling failed; failing it", s.request.request_id)
                into.failed.append((s.request, "sampling failed"))


def _sample(
    logits: torch.Tensor, spans: list[tuple[ScheduledRequest, int, int]], into: RunnerOutput
) -> None:
    """`sample_step` over `spans` of `logits`; requests with non-finite rows fail alone."""
    # a row's sum is NaN/+inf iff the row holds a NaN/+inf (logits are far below float32's
    # overflow): one pass over [rows, vocab] instead of isfinite's four. -inf is a masked token
    # (a grammar's), not a fault.
    sums = logits.sum(dim=-1) if spans else logits.new_empty(0)
    finite = (~(sums.isnan() | sums.isposinf())).tolist()
    plain, drafted = [], []
    for s, a, b in spans:
        if not all(finite[a:b]):
            log.error("request %s: non-finite logits; failing it", s.request.request_id)
            into.failed.append((s.request, "the model produced NaN/inf logits"))
        elif s.num_spec:
            drafted.append((s, a, b))
        else:
            plain.append((s, a))
    sampled: list[tuple[ScheduledRequest, SamplerOutput]] = []
    refusals: list[Request] = []
    if plain:
        picked, plain_logits = [a for _, a in plain], logits
        if picked != list(range(logits.shape[0])):  # all rows in order: no gather, no upload
            plain_logits = logits.index_select(0, torch.tensor(picked, device=logits.device))
        res = sample(plain_logits, [s.request for s, _ in plain])
        refused = set(res.refused)
        for i, ((s, _), t, lp) in enumerate(zip(plain, res.token_ids, res.logprobs)):
            if i in refused:
                refusals.append(s.request)
            else:
                sampled.append((s, SamplerOutput([t], [lp])))
    if drafted:
        rows = torch.cat([torch.arange(a, b) for _, a, b in drafted]).to(logits.device)
        verified = verify(logits.index_select(0, rows), [s.request for s, _, _ in drafted])
        for (s, _, _), res in zip(drafted, verified):
            if res.refused:
                refusals.append(s.request)
            else:
                sampled.append((s, res))
    into.sampled.extend(sampled)  # only once the whole call succeeded
    for request in refusals:
        log.warning("request %s: %s; ending it", request.request_id, NOTHING_ALLOWED)
        into.failed.append((request, NOTHING_ALLOWED))
