"""Where each request's draft tokens come from, each step: the source with the most expected
accepted tokens among those the server has.

- grammar: the tokens a request's constraint forces next (a JSON key, punctuation, a tool's
  name: xgrammar's jump-forward tokens). Its tokenization may differ from the model's, so they
  are drafts like any other and verified.
- suffix: the continuation of the longest n-gram ending the request that occurred earlier in
  its prompt and output, else in the recent outputs of requests with the same cache salt
  (engine/spec/suffix_index.py): a tenant's drafts never come from another's outputs, so the time a
  request takes says nothing about what others were told.
- corpus: the continuation the model's own answers to a broad prompt set most often give the
  longest n-gram ending the request (engine/spec/answer_corpus.py, built offline per model and
  keyed to its weights like the head): free text's stock phrasing without a trained head.
- eagle: the draft head's chain (engine/spec/eagle.py), run by this drafter before it picks,
  as deep as the measured costs make worthwhile.

A source's running acceptance per request (alpha: the share of its drafts the target kept)
bounds how deep it drafts (draft j survives with probability ~alpha^j; below MIN_GAIN a row
costs more than it returns) and gives its expected accepted length, alpha + ... + alpha^L.
Grammar and suffix drafts are deterministic (q is one-hot): the verifier accepts draft d with
probability p(d) and otherwise samples p without d, so sampling stays exactly the target's.

The drafter is the one speculation controller: one acceptance record per request and source
(`DraftState`), one k per step (`current_k`, what /metrics exports), one cost model.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from engine.core.batch import StepUpdate
from engine.core.request import Request
from engine.spec.answer_corpus import CONTEXT_TOKENS, AnswerCorpus
from engine.spec.cost import ServedCosts, SpecCostModel
from engine.spec.draft_state import DraftState, SpecStats, expected_accepted, useful_depth
from engine.spec.eagle import EagleDrafts, StepPlan, room_for_drafts
from engine.spec.suffix_index import NGRAM_SIZES, RecentOutputs, SuffixIndex

MAX_SALTS = 64  # tenants / applications with recent outputs kept
RECENT_PICKS = 32  # finished requests whose picks /v1/stats shows
RECENT_TOKENS_PER_SALT = 1 << 15
SHORT_MATCH = 3  # a match of fewer tokens drafts at most this many: it is a weak guess


def state_of(r: Request) -> DraftState:
    """A request's drafting state, made at its first decoding step."""
    if r.drafts is None:
        r.drafts = DraftState(SuffixIndex(r.all_token_ids))
    return r.drafts


class Drafter:
    """After each step: records how many drafts the verifier kept, runs the draft head (when
    it is a source), picks each decoding request's drafts among `sources`, and remembers
    finished outputs for suffix drafts. `cost`: the measured step costs (None: the row cap
    alone sizes k); `encode`: the model's tokenizer, for grammar drafts."""

    def __init__(
        self,
        sources: tuple[str, ...],
        max_tokens: int,
        max_verify_rows: int,
        cost: SpecCostModel | None = None,
        encode: Callable[[str], list[int]] | None = None,
        eagle: EagleDrafts | None = None,
        corpus: AnswerCorpus | None = None,
    ) -> None:
        self.eagle = eagle
        self.corpus = corpus
        self.sources = sources
        # the last requests' picks and acceptance by source (/v1/stats: why one sped up)
        self.recent_picks: deque[dict] = deque(maxlen=RECENT_PICKS)
        self.max_tokens = max_tokens
        self.max_verify_rows = max_verify_rows
        self.cost = cost
        # served decode steps against `cost`'s prediction, by rows (what verify rows cost served)
        self.served = ServedCosts()
        # recent outputs per cache salt, the least recently used salt dropped past MAX_SALTS
        self.recent: OrderedDict[str | None, RecentOutputs] = OrderedDict()
        self.stats = {s: SpecStats() for s in sources}
        self.current_k = max_tokens
        # grammar drafts as the model's tokenizer spells the forced text: kept more often than
        # xgrammar's longest-match tokens (JSON extraction: 49/49 vs 42/54 drafts kept,
        # bench/speculative.py), which serve where there is no tokenizer
        self.encode = encode

    def step(self, update: StepUpdate, hidden: torch.Tensor | None, plan: StepPlan | None) -> None:
        """Everything speculation does after a step's update: record what verification kept,
        let the head catch up and chain (`hidden`: the step's features, None when its forward
        failed), pick each decoding request's drafts for the next step."""
        for e in update.emitted:
            if e.num_drafted:
                self.record(e.request, e.num_drafted, e.num_accepted)
        decoding = [e.request for e in update.emitted if not e.request.is_finished]
        for r in decoding:  # the head's budget reads each request's eagle acceptance
            state_of(r)
        if self.eagle is not None and hidden is not None:
            self.eagle.catch_up_and_draft(update, hidden, plan, self.eagle_depth(decoding))
        self.propose(decoding)
        for request in update.finished:
            self.finished(request)

    def eagle_depth(self, proposing: list[Request]) -> int:
        """How deep the head chains this step for `proposing` requests at their mean eagle
        acceptance: by the measured costs (drafting itself costs a head step per depth), else
        the row cap alone; `propose` may cut it further."""
        if not proposing:
            return self.max_tokens
        alpha = sum(r.drafts.acceptance["eagle"] for r in proposing if r.drafts) / len(proposing)
        n = len(proposing)
        if self.cost is not None:
            return self.cost.best_k(n, alpha, self.max_tokens, self.max_verify_rows)
        return max(0, min(self.max_tokens, self.max_verify_rows // n - 1))

    def observe_step(self, rows: int, seconds: float) -> None:
        """A served decode step (no prompt rows) of `rows` rows, drafting included."""
        if self.cost is not None:
            self.served.observe(rows, self.cost.target(rows), seconds)

    def verify_s(self, rows: int) -> float:
        """A step of `rows` decode and verify rows: the startup table, scaled as served."""
        assert self.cost is not None
        return self.cost.target(rows) * self.served.scale(rows)

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The verifier kept `num_accepted` of the request's `num_drafted` drafts."""
        state = request.drafts
        if state is None or state.source is None or not num_drafted:
            return
        self.stats[state.source].record(num_drafted, num_accepted)
        state.record(state.source, num_drafted, num_accepted)

    def total_stats(self) -> SpecStats:
        total = SpecStats()
        for st in self.stats.values():
            total.num_drafts += st.num_drafts
            total.num_draft_tokens += st.num_draft_tokens
            total.num_accepted_tokens += st.num_accepted_tokens
            for j, n in enumerate(st.accepted_per_position):
                if j == len(total.accepted_per_position):
                    total.accepted_per_position.append(0)
                total.accepted_per_position[j] += n
        return total

    def finished(self, request: Request) -> None:
        state = request.drafts
        if state is not None and state.picks:
            steps = sum(state.picks.values())
            self.recent_picks.append(
                {
                    "request_id": request.request_id,
                    "steps": steps,
                    "share_by_source": {s: round(n / steps, 3) for s, n in state.picks.items()},
                    "acceptance": {
                        s: round(a, 3) for s, a in state.acceptance.items() if s in self.sources
                    },
                }
            )
        if "suffix" in self.sources and request.num_output_tokens > 1:
            salt = request.sampling_params.cache_salt
            recent = self.recent.pop(salt, None) or RecentOutputs(RECENT_TOKENS_PER_SALT)
            recent.add(request.output_token_ids)
            self.recent[salt] = recent
            while len(self.recent) > MAX_SALTS:
                self.recent.popitem(last=False)

    def propose(self, requests: list[Request]) -> None:
        """Set each request's `spec_token_ids` (and `spec_probs`) for the next step. EAGLE's
        drafts, when that source is on, are already there (the head ran first). Each
        request's best candidate is found at full depth; then one k for the step caps them all
        (`step_k`), and the pick is applied."""
        if 2 * len(requests) > self.max_verify_rows:
            # not even one draft each fits the step's rows: no candidates to look for (each
            # request's suffix index catches up when it is next asked)
            for r in requests:
                if r.drafts is not None:
                    r.drafts.source = None
            self.current_k = 0
            return
        picks = [self._best(r, room_for_drafts(r, self.max_tokens)) for r in requests]
        k = self.step_k(picks)
        for r, (source, drafts, _) in zip(requests, picks):
            self._apply(r, source, drafts[:k])
            for other in self.sources:
                if other != r.drafts.source:  # type: ignore[union-attr]
                    r.drafts.relax(other)  # type: ignore[union-attr]

    def step_k(self, picks: list[tuple[str, list[int], float]]) -> int:
        """The most drafts per request this step. By the measured verify cost: the k with the
        most expected tokens per second over these candidates (a request with a draft of
        length L at acceptance alpha brings 1 + alpha + ... + alpha^min(k, L) tokens for
        1 + min(k, L) rows; suffix and grammar drafts cost nothing to make), the rows' cost
        as served steps of as many rows measured it (`verify_s`: verify rows grow dearer with
        the batch on the served path, and drafting turns down with them). Without costs,
        the row cap alone: batch x (1 + k) <= max_verify_rows."""
        n = len(picks)
        if n == 0:
            return 0  # no step to size: the last k stays what /metrics shows
        if self.cost is None:
            k = max(0, min(self.max_tokens, self.max_verify_rows // n - 1))
            self.current_k = k
            return k
        longest = max(len(d) for _, d, _ in picks)
        best_k, best_rate = 0, n / self.verify_s(n)
        eagle = any(source == "eagle" for source, _, _ in picks)
        for k in range(1, longest + 1):
            rows = sum(1 + min(k, len(d)) for _, d, _ in picks)
            if rows > self.max_verify_rows:
                break
            tokens = n + sum(expected_accepted(alpha, min(k, len(d))) for _, d, alpha in picks)
            secs = self.verify_s(rows) + (self.cost.chain(n, k) if eagle else 0.0)
            if tokens / secs > best_rate:
                best_k, best_rate = k, tokens / secs
        self.current_k = best_k
        return best_k

    def _best(self, r: Request, k: int) -> tuple[str, list[int], float]:
        """The candidate draft with the most expected accepted tokens: (source, drafts, the
        source's acceptance for this request), or ("", [], 0.0) when no source has one."""
        state, params = state_of(r), r.sampling_params
        if params.thought_budget is not None:  # its end may have to be forced at any row
            return "", [], 0.0
        best: tuple[float, str, list[int]] = (0.0, "", [])
        # the head was trained on the base model's features: an adapter's rows take the other
        # sources' drafts (still verified by the adapter's model)
        if "eagle" in self.sources and r.spec_token_ids and r.lora is None:
            eagle = r.spec_token_ids[:k]
            best = (expected_accepted(state.acceptance["eagle"], len(eagle)), "eagle", eagle)
        # A seeded sampled request is not drafted for: how many uniforms verification draws
        # depends on the drafts, and suffix drafts on what other requests wrote, so its tokens
        # would depend on more than its seed (greedy output never depends on drafts).
        reproducible = params.seed is None or params.greedy
        for source in ("grammar", "suffix", "corpus"):
            if source not in self.sources or k == 0 or not reproducible:
                continue
            alpha = state.acceptance[source]
            drafts = self._draft(source, r, min(k, useful_depth(alpha)))
            gain = expected_accepted(alpha, len(drafts))
            if drafts and gain > best[0]:
                best = (gain, source, drafts)
        _, source, drafts = best
        return source, drafts, state.acceptance[source] if source else 0.0

    @staticmethod
    def _apply(r: Request, source: str, drafts: list[int]) -> None:
        assert r.drafts is not None
        r.drafts.source = source or None
        r.drafts.picks[source or "none"] = r.drafts.picks.get(source or "none", 0) + 1
        if source != "eagle":
            r.spec_token_ids, r.spec_probs = drafts, None
        elif len(drafts) < r.num_spec:
            del r.spec_token_ids[len(drafts) :]
            if r.spec_probs is not None:
                r.spec_probs = r.spec_probs[: len(drafts)]

    def _draft(self, source: str, r: Request, k: int) -> list[int]:
        if source == "grammar":
            m = r.matcher
            if m is None or m.is_terminated():
                return []
            if self.encode is None:
                return m.find_jump_forward_tokens()[:k]
            text = m.find_jump_forward_string()
            ids = self.encode(text) if text else []
            # the last token may be the start of a longer one the model would write
            return ids[: min(k, len(ids) - 1)] if len(ids) > 1 else []
        if source == "corpus":
            assert self.corpus is not None
            return self.corpus.match(r.all_token_ids[-CONTEXT_TOKENS:], k)[0]
        assert r.drafts is not None
        drafts, n = r.drafts.index.match(k)
        if not drafts:
            recent = self.recent.get(r.sampling_params.cache_salt)
            if recent is not None:
                drafts, n = recent.match(r.all_token_ids[-max(NGRAM_SIZES) :], k)
        return drafts[: k if n >= SHORT_MATCH else min(k, n)]
