"""EAGLE drafts: the draft head as one draft source of the drafter (engine/spec/drafting.py),
batched across requests. It decides nothing: the drafter gives it each step's chain length and
reads each request's acceptance from its `DraftState`. The lossless verifier every draft source
shares is engine/spec/verify.py.

Per engine step, after the target's forward and verification:
1. Catch-up: the head runs over every position the target just computed and kept (p), with the
   token that follows it (t_{p+1}) and the target's feature f_p, writing the draft layer's KV in
   its own KV group of the shared pool. Its output at a request's last position is the predicted
   next feature, whose logits give the first draft token.
2. Chain: k-1 single-token steps feed the head its own predicted feature and the token it drafted.
   The KV these write is provisional; next step's catch-up overwrites it with true features.
Draft KV at a position is written in the same step as the target's KV there, so blocks shared
through the prefix cache carry both.

Verification (engine/spec/verify.py): one target forward over [last token, d_1..d_k]; greedy rows
accept while the draft equals the target's argmax; sampled rows accept d with probability
min(1, p(d)/q(d)) and otherwise resample from norm(max(0, p - q)); a bonus token on full
acceptance. p and q both go through the request's temperature/top_k/top_p/min_p; logit_bias,
min_tokens and penalties see the drafted prefix of each row, so every emitted token is
distributed exactly as without speculation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionStep
from engine.core.batch import StepUpdate
from engine.core.request import Request
from engine.runner.sampler import sampling_probs
from engine.runner.step_inputs import step_metadata
from engine.spec.draft_state import useful_depth
from models.eagle.head import EagleHead

if TYPE_CHECKING:
    from engine.grammar.structured_output import StructuredOutputs

StepPlan = tuple[torch.Tensor, AttentionStep]  # a forward's positions and attention plan


@dataclass(slots=True)
class CatchUp:
    """Positions [start, start + num_kept) of `request` whose target features are `features`."""

    request: Request
    start: int
    features: torch.Tensor
    propose: bool  # draft k tokens after catching up


def room_for_drafts(r: Request, k: int) -> int:
    """At most k drafts, and never one past max_tokens or the context length (the target's own
    token follows the drafts in the same step)."""
    room = min(r.sampling_params.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens)
    return max(0, min(k, room - 1))


def catch_up_items(update: StepUpdate, hidden: torch.Tensor) -> list[CatchUp]:
    """What the head catches up over after a step: each scheduled request's positions the
    target computed and kept, with their features; a request that sampled (and did not fail or
    finish) then proposes. Finished requests catch up too: their cached blocks keep complete
    draft KV."""
    failed = {r.request_id for r, _ in update.failed}
    sampled = {e.request.request_id for e in update.emitted}
    items, row = [], 0
    for s in update.scheduled.scheduled:
        r = s.request
        first = update.first[r.request_id]
        kept = r.num_computed_tokens - first
        if r.request_id not in failed and kept > 0:
            # only a chunk that sampled proposes: it alone got lookahead slots
            features = hidden[row : row + kept]
            propose = r.request_id in sampled and not r.is_finished
            items.append(CatchUp(r, first, features, propose))
        row += s.num_new_tokens
    return items


class EagleDrafts:
    """Runs the head over the pool's extra KV group: the catch-up over the step's kept
    positions, then a chain of at most k drafts for each proposing request."""

    def __init__(
        self,
        head: EagleHead,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
        block_ids: Callable[[str], list[int]],
        grammars: StructuredOutputs | None,
    ) -> None:
        self.head = head
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.block_ids = block_ids  # a live request's block table (the KV manager's)
        self.grammars = grammars  # constrained requests draft inside their grammar

    def catch_up_and_draft(
        self, update: StepUpdate, hidden: torch.Tensor, plan: StepPlan | None, k: int
    ) -> None:
        """The step's catch-up and each proposing request's chain; `plan`: the target step's
        positions and attention plan, reused when the catch-up covers exactly its tokens."""
        items = catch_up_items(update, hidden)
        scheduled = update.scheduled.scheduled
        whole_step = len(items) == len(scheduled) and all(
            i.features.shape[0] == s.num_new_tokens for i, s in zip(items, scheduled)
        )
        tables = {}
        for i in items:
            rid = i.request.request_id
            tables[rid] = update.tables[rid] if rid in update.tables else self.block_ids(rid)
        self.run(items, tables, k, plan if whole_step else None)

    @torch.inference_mode()
    def run(
        self,
        items: list[CatchUp],
        tables: dict[str, list[int]],
        k: int,
        step_plan: StepPlan | None = None,
    ) -> None:
        """Catch the draft KV up over `items`, then set `spec_token_ids`/`spec_probs` on the
        requests that propose (at most k each, fewer near max_tokens / max_model_len).
        `step_plan`: the target step's positions and plan, when the catch-up covers exactly
        the step's tokens."""
        for item in items:
            item.request.spec_token_ids, item.request.spec_probs = [], None
        if not items:
            return
        head = self.head
        tokens, lens = [], []
        for item in items:
            n = item.features.shape[0]
            tokens.extend(item.request.all_token_ids[item.start + 1 : item.start + n + 1])
            lens.append(n)
        if step_plan is not None:
            positions, attn = step_plan
        else:
            seqs = [(tables[i.request.request_id], i.start, n) for i, n in zip(items, lens)]
            positions, meta = step_metadata(seqs, self.block_size, self.device)
            attn = self.backend.plan(meta)
        features = head.target_features(torch.cat([i.features for i in items]))
        hidden = head(torch.tensor(tokens, device=self.device), features, positions, attn)
        ends = torch.tensor(lens, device=self.device).cumsum(0) - 1
        proposers = [j for j, item in enumerate(items) if item.propose]
        budgets = [self._budget(items[j].request, k) for j in proposers]
        active = [(j, b) for j, b in zip(proposers, budgets) if b > 0]
        if not active:
            return
        reqs = [items[j].request for j, _ in active]
        budget = [b for _, b in active]
        last = hidden.index_select(0, ends[[j for j, _ in active]])
        pos = [r.num_tokens - 1 for r in reqs]  # position of the last real token
        # drafts advance their requests' grammars (so the next draft is masked at the right
        # state); every draft is rolled back after the chain: the verifier decides
        advanced = [0] * len(reqs)
        for step in range(max(budget)):
            live = [i for i, b in enumerate(budget) if b > step]
            drafted = self._draft_tokens(last, reqs, live, advanced)
            if step + 1 >= max(budget):
                break
            seqs = [(tables[reqs[i].request_id], pos[i] + step, 1) for i in range(len(reqs))]
            positions, meta = step_metadata(seqs, self.block_size, self.device)
            last = head(
                torch.tensor(drafted, device=self.device),
                last,
                positions,
                self.backend.plan(meta),
                from_target=False,
            )
        for r, n in zip(reqs, advanced):
            if n:
                r.matcher.rollback(n)

    def _budget(self, r: Request, k: int) -> int:
        """Drafts a request may carry: k, but never past max_tokens or the context length, and
        only as deep as its own acceptance makes worthwhile (draft j survives with probability
        about alpha^j; below MIN_GAIN the draft step and the extra verify row cost more than
        they return). At least one draft, so a request whose acceptance recovers is noticed."""
        if r.is_finished or k == 0 or r.sampling_params.thought_budget is not None:
            return 0
        assert r.drafts is not None  # the drafter gives every decoding request its state
        return room_for_drafts(r, min(k, useful_depth(r.drafts.acceptance["eagle"])))

    def _draft_tokens(
        self, hidden: torch.Tensor, reqs: list[Request], live: list[int], advanced: list[int]
    ) -> list[int]:
        """Draft one token per request from the head's predicted features; append it (and, for
        sampled requests, its draft distribution q) to the `live` requests. Constrained
        requests draft what their grammar allows (`advanced[i]`: drafts their grammar took)."""
        logits = self.head.logits(hidden)
        token_map = self.head.token_map
        constrained = [
            i for i in live if reqs[i].matcher is not None and not reqs[i].matcher.is_terminated()
        ]
        if constrained and self.grammars is not None and token_map is None:
            matchers = [reqs[i].matcher for i in constrained]
            self.grammars.mask_logits(logits, constrained, matchers)
        greedy = logits.argmax(-1)
        out = (token_map[greedy] if token_map is not None else greedy).tolist()
        sampled = [i for i in live if not reqs[i].sampling_params.greedy]
        if sampled:
            rows = logits[sampled]
            if token_map is not None:
                vocab = self.head.embed.weight.shape[0]
                full = rows.new_full((len(sampled), vocab), float("-inf"))
                rows = full.index_copy_(1, token_map, rows)
            q = sampling_probs(rows, [reqs[i].sampling_params for i in sampled])
            for row, i in enumerate(sampled):
                r = reqs[i]
                out[i] = int(torch.multinomial(q[row], 1, generator=r.generator))
                qi = q[row : row + 1]
                r.spec_probs = qi if r.spec_probs is None else torch.cat([r.spec_probs, qi])
        for i in live:
            reqs[i].spec_token_ids.append(out[i])
            m = reqs[i].matcher
            if m is not None and advanced[i] == len(reqs[i].spec_token_ids) - 1:
                advanced[i] += not m.is_terminated() and m.accept_token(out[i])
        return out
