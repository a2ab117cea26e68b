"""EAGLE speculative decoding: the proposer (draft head, batched across requests). The lossless
verifier every draft source shares is engine/spec/verify.py.

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

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, AttentionStep
from engine.core.request import Request
from engine.runner.sampler import sampling_probs
from engine.runner.step_inputs import step_metadata
from engine.spec.cost import SpecCostModel
from models.eagle.head import EagleHead

if TYPE_CHECKING:
    from engine.grammar.structured_output import StructuredOutputs


MIN_GAIN = 0.1  # expected accepted tokens a draft position must bring to be drafted


def useful_depth(alpha: float) -> int:
    """The deepest draft worth a verify row at per-draft acceptance alpha: draft j survives
    with probability about alpha^j, and below MIN_GAIN it costs more than it returns. At least
    one, so a source whose acceptance recovers is noticed."""
    alpha = min(alpha, 0.99)
    return max(1, int(math.log(MIN_GAIN) / math.log(alpha))) if alpha > 0 else 1


def record_acceptance(r: Request, num_drafted: int, num_accepted: int) -> None:
    """Update a request's running acceptance rate after a verification round."""
    if num_drafted:
        r.spec_acceptance = 0.7 * r.spec_acceptance + 0.3 * (num_accepted / num_drafted)


@dataclass(slots=True)
class SpecStats:
    num_drafts: int = 0  # verification rounds that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.append(0)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the target's own token)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class CatchUp:
    """Positions [start, start + num_kept) of `request` whose target features are `features`."""

    request: Request
    start: int
    features: torch.Tensor
    propose: bool  # draft k tokens after catching up


class Proposer:
    """Runs the head over the pool's extra KV group. Adaptive k: verification stays in the
    memory-bound regime while the step's target rows (batch x (1 + k)) are few; beyond
    `max_verify_rows` the matmuls turn compute-bound and speculation no longer pays, so k shrinks
    with the batch (down to 0). `current_k` is exported in /metrics."""

    def __init__(
        self,
        head: EagleHead,
        backend: AttentionBackend,
        block_size: int,
        num_speculative_tokens: int,
        max_verify_rows: int,
        device: torch.device,
    ) -> None:
        self.head = head
        self.backend = backend
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.max_verify_rows = max_verify_rows
        self.device = device
        self.current_k = num_speculative_tokens
        self.stats = SpecStats()
        # constrained requests draft inside their grammar (set by the builder)
        self.structured: StructuredOutputs | None = None
        self.cost: SpecCostModel | None = None  # measured by the builder (engine/spec/cost.py)

    def choose_k(self, num_decoding: int, acceptance: float = 0.7) -> int:
        """k for this step's `num_decoding` proposing requests, whose per-draft acceptance
        averages `acceptance`: by the measured cost model, else the row cap alone."""
        if num_decoding <= 0:
            return self.k
        if self.cost is not None:
            self.current_k = self.cost.best_k(
                num_decoding, acceptance, self.k, self.max_verify_rows
            )
        else:
            self.current_k = max(0, min(self.k, self.max_verify_rows // num_decoding - 1))
        return self.current_k

    @torch.inference_mode()
    def run(
        self,
        items: list[CatchUp],
        tables: dict[str, list[int]],
        k: int,
        step_plan: tuple[torch.Tensor, AttentionStep] | None = None,
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
        params = r.sampling_params
        if r.is_finished or k == 0:
            return 0
        room = min(params.max_tokens - r.num_output_tokens, r.max_model_len - r.num_tokens)
        return max(0, min(k, useful_depth(r.spec_acceptance), room - 1))

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
        if constrained and self.structured is not None and token_map is None:
            matchers = [reqs[i].matcher for i in constrained]
            self.structured.mask_logits(logits, constrained, matchers)
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
