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
