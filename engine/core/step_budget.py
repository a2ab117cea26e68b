"""How many tokens a step may take, and in what order prefills get them: the scheduler's policy
for time to first token and inter-token latency, from step costs measured at startup
(engine/build/step_costs.py). Pure: no clock, no model.

A step's latency is what every request in it waits. A 1,024-token prefill chunk makes a step
last as long as that chunk takes, and everything else waits behind it: a decode row's next
token, a prefix hit's one short chunk, and every request that arrives meanwhile (the engine
reads its inbox only between steps). Cutting every chunk small costs throughput, though (each
step reads the weights again, and a later chunk reads its earlier context again), so:

- With no short prefill around, a step takes the full budget.
- While a short prefill (at most `short_tokens` uncached: a prefix hit, a new turn) waits, or
  one arrived within `hold_s` while requests still decode (they come in streams: the next is
  likely to land mid-step; with nothing decoding, a lone long prompt takes full steps),
  long prefills' chunks are held to `target_rows` a step, the most that fit in the target
  latency: by default the shortest step whose prefill costs within `EFFICIENT_TOLERANCE` a
  token of the cheapest measured. A short prefill then waits at most one such step to be
  admitted, and takes its whole remainder in one step.
- A step that carries streamed decode rows (a client reading tokens as they come) gives its
  prefills at most `stream_rows` tokens (Sarathi-Serve's stall-free batching): the shortest
  measured step whose prefill costs within `STREAM_TOLERANCE` a token of the cheapest, so the
  streams' inter-token latency stays near a short step's while a long prompt costs a little
  more a token; or, with `max_itl_factor`, at most that many times their decode step alone.
  Either bound holds as long as every pending prefill still finishes within `YIELD_SLOWDOWN`
  times its prefill alone at the bounded rate; where some would not, it gives way by the
  tokens of those (in deadline order, up to the last that would miss): a newcomer's short
  prompt widens one step by itself, a queue of prompts lifts the bound, first tokens first.
- Prefills take their tokens in order of the deadline they would miss: arrival plus
  `SLOWDOWN` times what their uncached tokens cost alone. A prefix hit's suffix is due soon
  after it arrives and goes first; a long prompt that has waited long enough is due earlier than
  a newcomer's, so nothing starves.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from math import ceil

# a chunk size is efficient when its cost per token is within this of the full budget's
EFFICIENT_TOLERANCE = 0.05
# beside streamed decode rows, a prefill's chunk may cost this much more a token (their ITL is
# the step's latency): on two cores a 64-token chunk, 50-90 ms against 170-320 ms for 256 (the
# 64-token step measured 12-24% dearer a token, so a tighter tolerance flips with noise)
STREAM_TOLERANCE = 0.25
# a request's time-to-first-token deadline: this many times its prefill alone after arrival
SLOWDOWN = 4.0
# streamed rows' bound gives way when a prefill would take more than this many times its
# prefill alone (tighter than the ordering's SLOWDOWN: under a queue, first tokens first)
YIELD_SLOWDOWN = 2.0
# steps stay held this many full steps' time after a short prefill arrived
HOLD_FULL_STEPS = 10
# without measured costs (a scheduler built by hand): a nominal cost per prefill token, so
# deadlines still order short before long at equal arrival
NOMINAL_TOKEN_S = 1e-3
# however the costs came out, steps stay held at most this long after a short arrival (a start
# beside a busy neighbour timed 2.4 s for one row: ten full steps were hours)
MAX_HOLD_S = 5.0
# the roofline's floor for a plausible one-row step: its weights read at this rate (a tenth of
# what one x86 core streams from DRAM) plus this much dispatch; a slower measurement is a
# process starved of CPU while it was timed, not this device's cost
MIN_READ_BYTES_S = 1e9
STEP_OVERHEAD_S = 0.05


def plausible_step_s(weight_bytes: int) -> float:
    """The slowest one-row step this device could take on its own (`MIN_READ_BYTES_S`)."""
    return weight_bytes / MIN_READ_BYTES_S + STEP_OVERHEAD_S


def piecewise_linear(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """ys at x, linear between measurements and extrapolated linearly past the ends."""
    if len(xs) == 1:
        return max(ys[0] * x / xs[0], 1e-9)
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)


def settle_costs(rows: tuple[int, ...], samples: list[list[float]]) -> tuple[float, ...]:
    """One cost per row count (ascending) from timed repeats of each, within the roofline's
    two sides whatever the samples say (a start beside a busy neighbour gave 17.9 / 34.2 /
    26.3 / 24.7 ms for 1-4 verify rows): load only adds time, so each row count's fastest
    repeat; the memory side (every step reads all the weights: more rows never cost less),
    so a smaller step's dearer figure is lowered to the larger one's; the compute side (r
    rows never cost more than the ceil(r / r') steps of r' rows that would carry them), so a
    larger step's figure is capped by every smaller one's. The result never falls with rows."""
    best = [min(s) for s in samples]
    for i in range(len(best) - 2, -1, -1):
        best[i] = min(best[i], best[i + 1])
    for i in range(1, len(best)):
        best[i] = min(best[i], *(ceil(rows[i] / rows[j]) * best[j] for j in range(i)))
    return tuple(best)


def unsettled(samples: list[list[float]], spread: float) -> bool:
    """Whether some row count's two fastest repeats differ by more than `spread` (load came
    and went during the measurement: another round is worth its time)."""
    for s in samples:
        fastest = sorted(s)[:2]
        if len(fastest) == 2 and fastest[1] > spread * fastest[0]:
            return True
    return False


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds of one step of `rows[i]` tokens (a chunk of one sequence after a short context),
    measured on this device, rows ascending."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def cost(self, rows: int) -> float:
        last, last_s = self.rows[-1], self.seconds[-1]
        if rows <= last:
            return piecewise_linear(self.rows, self.seconds, rows)
        # past the measured range, at least half the last step's cost a token: a flat last
        # segment (two steps within noise) must not make a long prefill look as cheap as the
        # last measured chunk
        slope = max(
            (piecewise_linear(self.rows, self.seconds, rows) - last_s) / (rows - last),
            0.5 * last_s / last,
        )
        return last_s + slope * (rows - last)

    def rows_within(self, seconds: float) -> int:
        """The most tokens a step can hold and still cost at most `seconds` (at least 1)."""
        lo, hi = 1, max(self.rows[-1], 1)
        while hi < 1 << 20 and self.cost(hi) <= seconds:
            hi *= 2
        while lo < hi:  # cost is monotone between measurements: bisect on it
            mid = (lo + hi + 1) // 2
            if self.cost(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def efficient_rows(self, full: int, tolerance: float = EFFICIENT_TOLERANCE) -> int:
        """The smallest measured step of at most `full` tokens whose cost per token is within
        `tolerance` of the cheapest (a big chunk is not always the cheapest a token:
        attention grows with it, and its activations leave the caches)."""
        measured = [(r, s) for r, s in zip(self.rows, self.seconds, strict=True) if r <= full]
        if not measured:
            return full
        cheapest = min(s / r for r, s in measured)
        return next(r for r, s in measured if s / r <= (1 + tolerance) * cheapest)

    def table(self) -> str:
        return ", ".join(
            f"{r}: {1000 * s:.1f} ms" for r, s in zip(self.rows, self.seconds, strict=True)
        )


@dataclass(frozen=True, slots=True)
class StepBudget:
    """The scheduler's limits for one step (see the module docstring)."""

    max_tokens: int  # max_num_batched_tokens: no step ever takes more
    costs: StepCosts | None = None  # None: every step may take max_tokens
    target_rows: int = 0  # tokens a step holds within the target latency (0: max_tokens)
    # prefill tokens a step with streamed decode rows may hold (0: unbounded), unless
    # max_itl_factor bounds it instead
    stream_rows: int = 0
    max_itl_factor: float = 0.0
    min_prefill_tokens: int = 16  # a step with prefills waiting gives them at least this
    short_tokens: int = 0  # a prefill of at most this is short (0: every step held to target)
    hold_s: float = 0.0  # steps stay held this long after a short prefill arrived

    @classmethod
    def measured(
        cls,
        max_tokens: int,
        costs: StepCosts,
        target_step_ms: float,
        max_itl_factor: float,
        min_prefill_tokens: int,
        short_tokens: int,
        stream_bound: bool = True,
    ) -> StepBudget:
        """target_step_ms 0: the efficient chunk's cost (`StepCosts.efficient_rows`).
        `stream_bound` False: streamed decode rows do not bound a step."""
        if target_step_ms > 0:
            target = costs.rows_within(target_step_ms / 1000)
        else:
            target = costs.efficient_rows(max_tokens)
        stream = costs.efficient_rows(max_tokens, STREAM_TOLERANCE) if stream_bound else 0
        # never a chunk below what a step with prefills waiting gives them anyway
        target, stream = max(target, min_prefill_tokens), stream and max(stream, min_prefill_tokens)
        hold = min(HOLD_FULL_STEPS * costs.cost(max_tokens), MAX_HOLD_S)
        return cls(
            max_tokens,
            costs,
            min(target, max_tokens),
            min(stream, max_tokens),
            max_itl_factor if stream_bound else 0.0,
            min_prefill_tokens,
            short_tokens,
            hold,
        )

    @property
    def bounds_streams(self) -> bool:
        """Whether streamed decode rows bound the steps they ride in."""
        return self.costs is not None and (self.max_itl_factor > 0 or self.stream_rows > 0)

    def is_short(self, prefill_tokens: int) -> bool:
        return 0 < prefill_tokens <= self.short_tokens

    @property
    def target_s(self) -> float | None:
        return self.costs.cost(self.target_rows) if self.costs and self.target_rows else None

    def describe(self) -> str:
        """The kernel matrix's line: what a step is held to, and the costs behind it."""
        if self.costs is None:
            # --target-step-ms -1, or costs timed while the CPU was busy (the log says which)
            return f"{self.max_tokens} tokens a step (not measured)"
        if self.max_itl_factor:
            itl = f"; with streamed decode rows at most {self.max_itl_factor:g}x their step alone"
        elif self.stream_rows:
            itl = f"; beside streamed decode rows {self.stream_rows} prefill tokens a step"
        else:
            itl = ""
        held = (
            f"while a prefill of at most {self.short_tokens} tokens waits or came in the "
            f"last {self.hold_s:.1f} s, "
            if self.short_tokens
            else ""
        )
        return (
            f"{held}{self.target_rows} of {self.max_tokens} tokens a step "
            f"({1000 * (self.target_s or 0):.0f} ms){itl}; measured {self.costs.table()}"
        )

    def prefill_tokens(
        self,
        decode_tokens: int,
        streamed_rows: int,
        now: float = 0.0,
        prefills: list[tuple[float, int]] | None = None,
        shorts_near: bool = True,
        cost_scale: float = 1.0,
    ) -> int:
        """Prefill tokens a step may add after its `decode_tokens` (decode and verification
        rows, `streamed_rows` of them streamed). `prefills`: (deadline, tokens left) of the
        prefills waiting or running, in deadline order: the streamed rows' bound holds only
        while every one of them still meets its deadline at the bounded rate (a prefill spike
        under light load is spread out; under a queue of prompts, first tokens come first).
        `shorts_near`: a short prefill waits or arrived within `hold_s`. `cost_scale`: served steps
        with prefill chunks' time over what the startup measurement predicts for them (a later
        chunk's earlier context, the decode rows' contexts); decode-only steps are taken at
        their measured cost."""
        held = self.target_rows and (shorts_near or not self.short_tokens)
        rows = self.target_rows if held else self.max_tokens
        room = max(rows - decode_tokens, self.min_prefill_tokens)
        if streamed_rows and self.bounds_streams:
            assert self.costs is not None
            if self.max_itl_factor > 0:
                # factor x the decode step alone, on served times, as a mixed step's cost
                itl = self.max_itl_factor * self.costs.cost(decode_tokens) / cost_scale
                bounded = max(
                    min(rows, self.costs.rows_within(itl)) - decode_tokens, self.min_prefill_tokens
                )
            else:
                bounded = max(self.stream_rows, self.min_prefill_tokens)
            per_token = cost_scale * self.costs.cost(decode_tokens + bounded) / bounded
            if bounded < room:
                room = min(room, max(bounded, _tokens_to_meet(prefills or [], now, per_token)))
        return min(room, self.max_tokens - decode_tokens)

    def predicted(self, tokens: int) -> float | None:
        return self.costs.cost(tokens) if self.costs is not None and tokens > 0 else None

    @staticmethod
    def yield_deadline(arrival: float, deadline: float) -> float:
        """When a prefill due at `deadline` stops letting streamed rows bound its steps."""
        return arrival + (deadline - arrival) * YIELD_SLOWDOWN / SLOWDOWN

    def deadline(self, arrival: float, uncached_tokens: int) -> float:
        """When a request's first token is due: SLOWDOWN times its prefill alone after arrival."""
        if self.costs is None:
            alone = NOMINAL_TOKEN_S * uncached_tokens
        else:
            alone = self.costs.cost(max(1, uncached_tokens))
        return arrival + SLOWDOWN * alone


def _tokens_to_meet(prefills: list[tuple[float, int]], now: float, per_token_s: float) -> int:
    """Served one after another in deadline order at `per_token_s` a token (EDF's
    feasibility test): the tokens of the prefills up to the last one that would finish after
    its deadline; 0 when every one meets it."""
    tokens = needed = 0
    for deadline, left in prefills:
        tokens += left
        if now + tokens * per_token_s > deadline:
            needed = tokens
    return needed
