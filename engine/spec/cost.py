"""What a verification step and a draft step cost on this device, measured at startup, and the
number of drafts per request that maximises expected tokens per second (adaptive speculation).

Verifying `batch x (1 + k)` rows costs about as much as `batch` rows while the matmuls are
memory-bound (the weights are read once either way); past that point each extra row costs
compute and speculation stops paying. Where that point lies depends on the device, the dtype
and the packed weights, so it is measured, not configured: `measure` times one target step of
1, 2, 4, ... rows (forward + logits) and one draft step of 1, 2, 4, ... rows (interleaved
rounds, settled within the roofline: engine/core/step_budget.settle_costs), and `best_k`
weighs the expected accepted tokens (acceptance alpha per draft: 1 + alpha + ... + alpha^k)
against `target(batch x (1 + k)) + (k - 1) x draft(batch)`: a head's first draft comes from the
catch-up forward it runs every step anyway (its KV must follow the target's), so only the
chain's further steps cost a draft step each.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend
from engine.core.step_budget import piecewise_linear, settle_costs, unsettled
from engine.runner.step_inputs import step_metadata
from models.eagle.head import EagleHead
from models.llama import LlamaForCausalLM

MEASURED_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64)  # fine where kernels switch


@dataclass(frozen=True, slots=True)
class SpecCostModel:
    rows: tuple[int, ...]
    target_s: tuple[float, ...]  # one target step of rows[i] rows
    draft_s: tuple[float, ...]  # one draft step of rows[i] rows

    def target(self, rows: int) -> float:
        return piecewise_linear(self.rows, self.target_s, rows)

    def draft(self, rows: int) -> float:
        return piecewise_linear(self.rows, self.draft_s, rows)

    def chain(self, batch: int, k: int) -> float:
        """What drafting k tokens for `batch` requests costs beyond the step's catch-up."""
        return max(0, k - 1) * self.draft(batch)

    def best_k(self, batch: int, acceptance: float, k_max: int, max_rows: int) -> int:
        """The k in 0..k_max (batch x (1 + k) <= max_rows) with the most tokens per second."""
        best_k, best = 0, batch / self.target(batch)
        alpha = min(max(acceptance, 0.0), 0.99)
        for k in range(1, k_max + 1):
            if batch * (1 + k) > max_rows:
                break
            tokens = batch * sum(alpha**j for j in range(k + 1))
            rate = tokens / (self.target(batch * (1 + k)) + self.chain(batch, k))
            if rate > best:
                best_k, best = k, rate
        return best_k

    def table(self) -> str:
        return ", ".join(
            f"{r}: {1000 * t:.1f}/{1000 * d:.1f} ms"
            for r, t, d in zip(self.rows, self.target_s, self.draft_s, strict=True)
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_step(step: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of `step` (the device synchronised on both sides)."""
    _sync(device)
    t = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t


# rounds of every step after its warm-up; more (up to MAX_ROUNDS) while some step's two
# fastest differ by over SETTLE_SPREAD (load came and went while it was measured)
ROUNDS, MAX_ROUNDS, SETTLE_SPREAD = 2, 5, 1.15


def timed_rounds(
    steps: list[Callable[[], object]],
    device: torch.device,
    rounds: int = ROUNDS,
    max_rounds: int = MAX_ROUNDS,
    spread: float = SETTLE_SPREAD,
    clock: Callable[[], float] = time.perf_counter,
    warm_up: bool = True,
) -> list[list[float]]:
    """Each step's timed repeats, after one warm-up call each (allocations, lazy packing;
    `warm_up` False: the caller made them): the steps interleaved round by round so that a
    burst of load lands on all of them alike, `rounds` of them, and more while the
    measurement is `unsettled`. `settle_costs` turns them into costs."""
    for step in steps if warm_up else ():
        step()
    times: list[list[float]] = [[] for _ in steps]
    done = 0
    while done < rounds or (done < max_rounds and unsettled(times, spread)):
        for i, step in enumerate(steps):
            _sync(device)
            t = clock()
            step()
            _sync(device)
            times[i].append(clock() - t)
        done += 1
    return times


def measured_shape(
    rows: tuple[int, ...], has_head: bool, num_blocks: int, block_size: int, context: int = 128
) -> tuple[int, tuple[int, ...]]:
    """The context and row counts `measure` times in a pool of `num_blocks`."""
    # the scratch writes must stay inside the pool (the ops do not bound-check block ids):
    # a small pool measures at a shorter context, and only the row counts that fit
    context = max(1, min(context, num_blocks * block_size // 2))
    need = -(-(context + 1) // block_size)  # blocks of one drafting sequence

    def fits(r: int) -> bool:  # the r-row target chunk, and r drafting sequences (a head's)
        drafts_fit = not has_head or r * need <= num_blocks
        return -(-(context + r) // block_size) <= num_blocks and drafts_fit

    return context, tuple(r for r in rows if fits(r)) or (1,)


@torch.inference_mode()
def measure(
    model: LlamaForCausalLM,
    head: EagleHead | None,
    backend: AttentionBackend,
    num_blocks: int,
    block_size: int,
    device: torch.device,
    rows: tuple[int, ...] = MEASURED_ROWS,
    context: int = 128,
) -> SpecCostModel:
    """Time target and draft steps on scratch blocks at startup (no request owns any block yet;
    the KV written there is never read as anyone's). Without a head, drafts cost nothing to
    make (suffix and grammar drafts)."""
    context, rows = measured_shape(rows, head is not None, num_blocks, block_size, context)
    steps = [chunk_step(model, backend, r, context, block_size, device) for r in rows]
    target_s = settle_costs(rows, timed_rounds(steps, device))
    draft_s = (0.0,) * len(rows)
    if head is not None:
        drafts = [_draft_step(model, head, backend, r, context, block_size, device) for r in rows]
        draft_s = settle_costs(rows, timed_rounds(drafts, device))
    return SpecCostModel(rows, target_s, draft_s)


def chunk_step(
    model, backend, rows: int, context: int, block_size: int, device, every_logit: bool = True
):
    """One sequence's chunk of `rows` tokens after `context`: a verification's rows (logits for
    each), or a prefill chunk's (`every_logit` False: the last row's only)."""
    table = list(range(-(-(context + rows) // block_size)))
    positions, meta = step_metadata([(table, context, rows)], block_size, device)
    ids = torch.zeros(rows, dtype=torch.long, device=device)

    def step() -> None:
        hidden = model(ids, positions, backend.plan(meta))
        model.compute_logits(hidden if every_logit else hidden[-1:])

    return step


def _draft_step(model, head, backend, rows: int, context: int, block_size: int, device):
    """One draft step of `rows` sequences (the head's forward and its logits)."""
    need = -(-(context + 1) // block_size)
    seqs = [(list(range(i * need, (i + 1) * need)), context, 1) for i in range(rows)]
    positions, meta = step_metadata(seqs, block_size, device)
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    dtype = model.embed_tokens.weight.dtype
    features = torch.zeros(rows, head.cfg.hidden_size, dtype=dtype, device=device)

    def step() -> None:
        hidden = head(ids, features, positions, backend.plan(meta), from_target=False)
        head.logits(hidden).argmax(-1)

    return step


# a served step moves its bucket's ratio this far; buckets above it relax this far toward it
SERVED_EMA, SERVED_RELAX = 0.2, 0.01


class ServedCosts:
    """Served decode steps' time against the startup table's prediction, by the step's rows
    (power-of-two buckets): the startup measurement times one sequence's chunk on a quiet
    pool, while a served verify step carries `batch` sequences' rows with their own contexts,
    the drafting and the verification. `scale(rows)` is what a step of `rows` costs served
    over predicted (interpolated between served buckets, 1.0 before any step), so the picker
    sees verify rows grow dearer with the batch as served. A bucket that
    is no longer served (drafting turned down) relaxes toward the ratio served below it, so
    drafting is tried again later rather than never."""

    def __init__(self) -> None:
        self.ratio: dict[int, float] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return max(rows, 1).bit_length()

    def observe(self, rows: int, predicted: float, seconds: float) -> None:
        if predicted <= 0 or seconds <= 0:
            return
        b, r = self.bucket(rows), min(seconds / predicted, 100.0)
        self.ratio[b] = (
            r if b not in self.ratio else (1 - SERVED_EMA) * self.ratio[b] + SERVED_EMA * r
        )
        for above in [a for a in self.ratio if a > b]:
            self.ratio[above] += SERVED_RELAX * (self.ratio[b] - self.ratio[above])

    def scale(self, rows: int) -> float:
        """The bucket's ratio; between served buckets, linear in the bucket; past the last
        or before the first, theirs."""
        b = self.bucket(rows)
        if b in self.ratio or not self.ratio:
            return self.ratio.get(b, 1.0)
        below = [a for a in self.ratio if a < b]
        above = [a for a in self.ratio if a > b]
        if not below or not above:
            return self.ratio[max(below) if below else min(above)]
        lo, hi = max(below), min(above)
        return self.ratio[lo] + (self.ratio[hi] - self.ratio[lo]) * (b - lo) / (hi - lo)
