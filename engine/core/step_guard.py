"""One request's fault stays its own. A step's inputs are checked before its forward (a token
outside the vocabulary fails its request, not the embedding lookup of the whole batch), and a
forward that fails anyway runs again request by request, so only the request whose rows make it
fail fails: a hostile draft, adapter or input never takes its batch-mates down.

The retry costs one forward per request, only in a step whose batched forward raised. A retried
step hands the draft head no hidden states (its requests' head KV misses that step: their
drafts may be weaker for a while, and verification keeps them lossless)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.batch import ScheduledRequest, SchedulerOutput
from engine.core.request import Request

if TYPE_CHECKING:
    from engine.core.batch import GrammarMask
    from engine.runner.model_runner import ModelRunner
    from engine.runner.runner_output import RunnerOutput

log = logging.getLogger("kvserve.engine")
GrammarOf = Callable[[list[ScheduledRequest]], "GrammarMask | None"]


def invalid_inputs(scheduled: list[ScheduledRequest], vocab: int) -> list[tuple[Request, str]]:
    """The scheduled requests whose step tokens leave the vocabulary. Prompts were checked at
    admission, so only what the engine made since is read: outputs and drafts (a few tokens a
    request in a decode step)."""
    bad = []
    for s in scheduled:
        r = s.request
        start = max(r.num_computed_tokens, r.num_prompt_tokens)
        end = r.num_computed_tokens + s.num_new_tokens - s.num_spec
        made = r.all_token_ids[start:end] + r.spec_token_ids[: s.num_spec]
        if made and (min(made) < 0 or max(made) >= vocab):
            wrong = next(t for t in made if not 0 <= t < vocab)
            log.error("request %s: token id %d outside the vocabulary", r.request_id, wrong)
            bad.append((r, f"token id {wrong} is outside the vocabulary [0, {vocab})"))
    return bad


def run_step(
    runner: ModelRunner, grammar_of: GrammarOf, out: SchedulerOutput, vocab: int
) -> RunnerOutput:
    """`runner.execute` on the step's healthy requests, with each its grammar mask; a failed
    batched forward is retried one request at a time. Failed requests are in `failed`."""
    bad = invalid_inputs(out.scheduled, vocab)
    if bad:
        dropped = {id(r) for r, _ in bad}
        out = SchedulerOutput([s for s in out.scheduled if id(s.request) not in dropped])
    ran = runner.execute(out, grammar_of(out.scheduled))
    if ran.forward_failed and len(out.scheduled) > 1 and runner.tp is None:
        log.warning("retrying the failed step's %d requests one by one", len(out.scheduled))
        ran = _one_by_one(runner, grammar_of, out.scheduled)
    ran.failed[:0] = bad
    return ran


def _one_by_one(
    runner: ModelRunner, grammar_of: GrammarOf, scheduled: list[ScheduledRequest]
) -> RunnerOutput:
    from engine.runner.runner_output import RunnerOutput

    merged = RunnerOutput()
    for item in scheduled:
        alone = runner.execute(SchedulerOutput([item]), grammar_of([item]))
        merged.sampled += alone.sampled
        merged.pooled += alone.pooled
        merged.scored += alone.scored
        merged.failed += alone.failed
    return merged
