"""A request's drafting state, as a leaf value object: the request owns one, the drafter
(engine/spec/drafting.py) fills and reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec.suffix_index import SuffixIndex

SOURCES = ("grammar", "suffix", "eagle")
PRIOR_ACCEPTANCE = {"grammar": 0.9, "suffix": 0.6, "eagle": 0.7}


@dataclass(slots=True)
class DraftState:
    """A request's drafting state (owned by its Request, freed with it)."""

    index: SuffixIndex
    acceptance: dict[str, float] = field(default_factory=lambda: dict(PRIOR_ACCEPTANCE))
    source: str | None = None  # the source of the drafts now in `spec_token_ids`
