"""A request's drafting state and the acceptance arithmetic every draft source shares, as a leaf:
the request owns a `DraftState`, the drafter (engine/spec/drafting.py) fills and reads it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.spec.suffix_index import SuffixIndex

SOURCES = ("grammar", "suffix", "corpus", "eagle")
PRIOR_ACCEPTANCE = {"grammar": 0.9, "suffix": 0.6, "corpus": 0.5, "eagle": 0.7}
MIN_GAIN = 0.1  # expected accepted tokens a draft position must bring to be drafted
# a source's acceptance drifts back to its prior by this share each step it does not draft: an
# estimate that fell (a stretch the head could not guess) is only ever updated by drafting, so
# without the drift a source written off early would never be tried again
RELAX = 0.05


@dataclass(slots=True)
class DraftState:
    """A request's drafting state (owned by its Request, freed with it): each source's running
    acceptance for this request (the share of its drafts the target kept), and the source of
    the drafts now in `spec_token_ids`."""

    index: SuffixIndex
    acceptance: dict[str, float] = field(default_factory=lambda: dict(PRIOR_ACCEPTANCE))
    source: str | None = None
    # the picker's choice for each of the request's decode steps: source -> steps ("none": no
    # source had a draft worth its verify row), for /v1/stats
    picks: dict[str, int] = field(default_factory=dict)

    def record(self, source: str, num_drafted: int, num_accepted: int) -> None:
        a = self.acceptance[source]
        self.acceptance[source] = 0.7 * a + 0.3 * (num_accepted / num_drafted)

    def relax(self, source: str) -> None:
        """`source` drafted nothing for this request this step: its acceptance drifts back
        toward the prior (RELAX)."""
        a = self.acceptance[source]
        self.acceptance[source] = a + RELAX * (PRIOR_ACCEPTANCE[source] - a)


def useful_depth(alpha: float) -> int:
    """The deepest draft worth a verify row at per-draft acceptance alpha: draft j survives
    with probability about alpha^j, and below MIN_GAIN it costs more than it returns. At least
    one, so a source whose acceptance recovers is noticed."""
    alpha = min(alpha, 0.99)
    return max(1, int(math.log(MIN_GAIN) / math.log(alpha))) if alpha > 0 else 1


def expected_accepted(alpha: float, length: int) -> float:
    return sum(alpha**j for j in range(1, length + 1))


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
