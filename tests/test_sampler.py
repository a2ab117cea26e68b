"""The sampler's draw (engine/runner/sampler.py): one uniform a row, inverted through the row's
cumulative distribution. Engine-level sampling is checked elsewhere (seeded requests reproduce
across batches in test_batching.py; speculation keeps the distribution in test_speculative.py)."""

from __future__ import annotations

import torch

from engine.runner.sampler import inverse_cdf


def test_draws_split_the_unit_interval_by_probability() -> None:
    """Uniforms evenly spread over [0, 1) land on each token in proportion to its probability,
    exactly; a row need not be normalised, and rows are independent."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 1.0, 0.0, 3.0]]) * 3
    n = 10_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    first = inverse_cdf(probs[:1].expand(n, -1), u)
    assert torch.bincount(first, minlength=4).tolist() == [5000, 0, 3000, 2000]
    second = inverse_cdf(probs[1:].expand(n, -1), u)
    assert torch.bincount(second, minlength=4).tolist() == [0, 2500, 0, 7500]


def test_a_token_of_probability_zero_is_never_drawn() -> None:
    """Not at u = 0 before a leading zero, nor at the largest u below 1 before trailing zeros
    (where u x total rounds up to the total)."""
    probs = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0]], dtype=torch.float32)
    top = torch.nextafter(
        torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    )
    assert inverse_cdf(probs, torch.tensor([0.0], dtype=torch.float64)).item() == 1
    assert inverse_cdf(probs, top.reshape(1)).item() == 2
    one_hot = torch.zeros(1, 49152)
    one_hot[0, 777] = 1.0
    for u in (0.0, 0.5, top.item()):
        assert inverse_cdf(one_hot, torch.tensor([u], dtype=torch.float64)).item() == 777


# ---- no invalid token ever leaves the sampler (#66) ----------------------------------------

from dataclasses import dataclass, field  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.runner.sampler import sample  # noqa: E402
from engine.spec.verify import verify  # noqa: E402

VOCAB = 40


@dataclass
class Row:
    """A request as the sampler reads it (engine/runner/sampler.py SamplingContext), with the
    draft fields verification reads."""

    sampling_params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=lambda: [1, 2, 3])
    eos_token_ids: frozenset[int] = frozenset({0})
    generator: torch.Generator | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt + self.output_token_ids

    @property
    def num_spec(self) -> int:
        return len(self.spec_token_ids)


params_strategy = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.3, 1.0, 1.7]),
    top_k=st.sampled_from([0, 1, 5]),
    top_p=st.sampled_from([1.0, 0.9, 0.2]),
    min_p=st.sampled_from([0.0, 0.1, 0.9]),
    presence_penalty=st.sampled_from([0.0, 1.5]),
    frequency_penalty=st.sampled_from([0.0, -1.0]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    min_tokens=st.sampled_from([0, 0, 3]),
    logit_bias=st.dictionaries(
        st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -5.0, 7.0]), max_size=6
    ),
    seed=st.sampled_from([None, 7]),
)


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[Row], torch.Tensor]:
    """Logits rows (finite, huge, +-inf or NaN entries, whole rows of -inf), each row's
    request, and an allow-mask (what a grammar allows: sometimes nothing)."""
    n = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 99))
    logits = torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed))
    allowed = torch.ones(n, VOCAB, dtype=torch.bool)
    rows = []
    for i in range(n):
        kind = draw(st.sampled_from(["plain", "masked", "empty", "neginf", "nan", "huge"]))
        if kind == "masked":
            allowed[i] = torch.rand(VOCAB) < draw(st.sampled_from([0.05, 0.5]))
        elif kind == "empty":
            allowed[i] = False
        elif kind == "neginf":
            logits[i] = float("-inf")
        elif kind == "nan":
            logits[i, draw(st.integers(0, VOCAB - 1))] = float("nan")
        elif kind == "huge":
            logits[i] *= 1e30
        params = draw(params_strategy)
        row = Row(params, draw(st.lists(st.integers(0, VOCAB - 1), max_size=4)))
        if params.seed is not None:
            row.generator = torch.Generator().manual_seed(params.seed)
        rows.append(row)
    return logits, rows, allowed


def _masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return logits.masked_fill(~allowed, float("-inf"))


def _could_pick(row: Row, logits: torch.Tensor, allowed: torch.Tensor, token: int) -> bool:
    """What every path must hold: in the vocabulary, allowed by the mask, not biased or
    min_tokens'd to -inf, and the raw logit not NaN."""
    p = row.sampling_params
    if not 0 <= token < VOCAB or not allowed[token] or torch.isnan(logits[token]):
        return False
    if p.min_tokens and row.num_output_tokens < p.min_tokens and token in row.eos_token_ids:
        return False
    return logits[token] > float("-inf")


@settings(max_examples=150, deadline=None)
@given(batches())
def test_every_sampled_id_is_in_range_and_allowed(batch) -> None:
    logits, rows, allowed = batch
    out = sample(_masked(logits, allowed), rows)
    assert len(out.token_ids) == len(rows)
    for i, (row, token) in enumerate(zip(rows, out.token_ids)):
        if i in out.refused:
            continue
        assert _could_pick(row, logits[i], allowed[i], token), (i, token, row.sampling_params)
    # a row with nothing allowed is refused, never answered with a token
    for i in range(len(rows)):
        if not allowed[i].any() or bool((logits[i] == float("-inf")).all()):
            assert i in out.refused


@settings(max_examples=100, deadline=None)
@given(batches(), st.integers(1, 3), st.integers(0, 99))
def test_every_verified_id_is_in_range_and_allowed(batch, k, seed) -> None:
    """Speculative verification (greedy and rejection sampling, drafts with and without q):
    every token it emits came from an allowed entry of its row."""
    logits, rows, allowed = batch
    gen = torch.Generator().manual_seed(seed)
    views, chunks, masks = [], [], []
    for i, row in enumerate(rows[:2]):
        row.spec_token_ids = torch.randint(0, VOCAB, (k,), generator=gen).tolist()
        if seed % 2:
            row.spec_probs = torch.rand(k, VOCAB, generator=gen).softmax(-1)
        views.append(row)
        picks = (torch.arange(k + 1) + i) % len(rows)  # the batch's rows as this one's k + 1
        chunks.append(logits[picks].clone())
        masks.append(allowed[picks])
    flat = _masked(torch.cat(chunks), torch.cat(masks))
    for row, res, chunk, mask in zip(views, verify(flat, views), chunks, masks):  # type: ignore[arg-type]
        if res.refused:
            assert res.token_ids == []
            continue
        for j, token in enumerate(res.token_ids):
            extra = Row(row.sampling_params, row.output_token_ids + row.spec_token_ids[:j])
            assert _could_pick(extra, chunk[j], mask[j], token), (j, token)
