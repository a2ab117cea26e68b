"""The prefix cache seen per application: hit rates, misses by cause, and cache breakers.

An application is named by the request: the `X-App` header, else the caller's API key (a short
hash of it), else `prompt_cache_key`, else `user`, else "default". The first MAX_APPS names get
their own label; later ones count as "other", so the metrics' label sets stay bounded whatever
clients send.

Every prompt token not served from a cache is counted under one cause, so the causes sum to
the misses (`attribute_misses`), read against the recent prompt of the same application that
shares the longest prefix with it:
- *eviction*: right after the hit, blocks that were cached here and evicted since (the engine
  reports them: the cache is too small);
- *uncached*: whole blocks the earlier prompt shares that were never cached when this one came
  (still being computed beside it, caching off, or evicted past the engine's memory of it);
- *divergence*: tokens the earlier prompt shares but that a small difference made computed again:
  the shared part of the block where the prompts part, and the identical tokens after the
  difference (a block hash covers everything before it: a timestamp or a request id in a system
  prompt). Each such divergence is a *breaker*, kept with where it happens (the token position),
  the tokens on each side in both prompts and the prefill it cost; a breaker that has cost at
  least a block twice is named in `/v1/stats` and a log line (at most once a minute);
- *partial_block*: shared tokens in the block where the prompts part without rejoining, or in
  the prompt's last, incomplete block (blocks are cached whole, and the last token is always
  computed for its logits);
- *salt*: whole blocks a recent prompt of another `cache_salt` shares (salts never share KV);
- *first_seen*: the rest, text no recent prompt of the application had there.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter

from engine.core.outputs import PrefixSummary

log = logging.getLogger("kvserve.cache")

MAX_APPS = 32  # labelled applications; the rest are "other"
RECENT_PROMPTS = 16  # per application, compared with each new prompt
MAX_SKETCH_TOKENS = 8192  # of each recent prompt
RESYNC_SEARCH = 64  # tokens a divergence may span in the new prompt
RESYNC_WINDOW = 8  # tokens that must match again to call it the same text
TOP_BREAKERS = 5
LOG_EVERY_S = 60.0
CONTEXT = 4  # tokens shown on each side of a break
TIERS = ("device", "host", "disk", "remote")


def common_prefix(a: array, b: array, start_a: int = 0, start_b: int = 0) -> int:
    """How many tokens a[start_a:] and b[start_b:] share from their start (binary search over
    slice equality: C-speed comparisons, no per-token Python)."""
    lo, hi = 0, min(len(a) - start_a, len(b) - start_b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[start_a : start_a + mid] == b[start_b : start_b + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Break:
    position: int  # the first token that differs (both prompts)
    new_span: int  # tokens that differ in the new prompt
    old_span: int  # ... and in the earlier one
    rejoined: int  # identical tokens after the differing spans (computed again)


def find_break(new: array, old: array, block: int) -> Break | None:
    """Where `new` leaves `old` for a few tokens and then continues as `old` does, if it does:
    for at least a block and four times the differing span (a different question before the
    same chat-template tail is not a break). None when `new` only extends `old`, or goes its
    own way."""
    min_rejoin = block
    p = common_prefix(new, old)
    if p >= len(new) - min_rejoin or p >= len(old):
        return None
    for d in range(1, RESYNC_SEARCH + 1):
        if p + d + RESYNC_WINDOW > len(new):
            return None
        window = new[p + d : p + d + RESYNC_WINDOW]
        hay = old[p : p + d + RESYNC_SEARCH + RESYNC_WINDOW]
        j = _find(hay, window)
        if j is not None:
            rejoined = common_prefix(new, old, p + d, p + j)
            if rejoined >= max(min_rejoin, 4 * max(d, j)):
                return Break(p, d, j, rejoined)
    return None


def _find(hay: array, needle: array) -> int | None:
    raw, pat, size = hay.tobytes(), needle.tobytes(), hay.itemsize
    at = raw.find(pat)
    while at >= 0 and at % size:  # aligned to a whole token
        at = raw.find(pat, at + 1)
    return at // size if at >= 0 else None


CAUSES = ("first_seen", "divergence", "eviction", "uncached", "partial_block", "salt")


def attribute_misses(
    n: int, hit: PrefixSummary, shared: int, brk: Break | None, other_salt: int, block: int
) -> dict[str, int]:
    """The prompt's `n - hit.cached` missed tokens by cause (the module docstring's). `shared`:
    tokens the closest recent prompt of the same salt shares from the start; `brk`: where it
    rejoins that prompt after a difference (positioned at `shared`); `other_salt`: tokens the
    closest recent prompt of another salt shares."""
    out = dict.fromkeys(CAUSES, 0)
    cacheable = (n - 1) // block * block  # the last token is always computed
    at = min(n, hit.cached + hit.evicted)
    out["eviction"] = at - hit.cached
    if other_salt > shared:
        end = max(at, min(other_salt, cacheable) // block * block)
        out["salt"], at = end - at, end
    if shared > at:
        full = max(at, min(shared, cacheable) // block * block)
        out["uncached"] = full - at
        out["divergence" if brk is not None else "partial_block"] = shared - full
        at = shared
    if brk is not None:  # at its position, unless a partial-block hit reached into it
        for cause, end in (
            ("first_seen", brk.position + brk.new_span),
            ("divergence", brk.position + brk.new_span + brk.rejoined),
        ):
            end = min(n, end)
            out[cause] += max(0, end - at)
            at = max(at, end)
    out["first_seen"] += n - at
    return out


@dataclass(slots=True)
class Breaker:
    app: str
    position: int
    new_text: str  # the few tokens before, the differing ones, and a few after
    old_text: str
    count: int = 0
    lost_tokens: int = 0  # identical tokens computed again, all occurrences
    last_logged: float = 0.0

    def as_dict(self) -> dict:
        return {
            "position": self.position,
            "new": self.new_text,
            "previous": self.old_text,
            "count": self.count,
            "lost_prefill_tokens": self.lost_tokens,
        }


@dataclass(slots=True)
class AppRecord:
    # recent prompts, with their cache salts
    recent: deque[tuple[array, str | None]] = field(
        default_factory=lambda: deque(maxlen=RECENT_PROMPTS)
    )
    prompt_tokens: int = 0
    cached_tokens: int = 0
    missed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    hit_rates: deque[float] = field(default_factory=lambda: deque(maxlen=30))  # per request
    breakers: dict[int, Breaker] = field(default_factory=dict)  # by the block broken


class AppCacheStats:
    """Owned by the server state; `observe` runs on the event loop, once per prompt."""

    def __init__(
        self,
        registry: CollectorRegistry,
        block_size: Callable[[], int],
        decode: Callable[[list[int]], str],
    ) -> None:
        self.block_size = block_size
        self.decode = decode
        self.apps: dict[str, AppRecord] = {}
        self.prompt_tokens = Counter(
            "kvserve:app_prompt_tokens",
            "Prompt tokens per application.",
            ["app"],
            registry=registry,
        )
        self.cached_tokens = Counter(
            "kvserve:app_cached_tokens",
            "Prompt tokens served from a cache tier, per application.",
            ["app", "tier"],
            registry=registry,
        )
        self.missed_tokens = Counter(
            "kvserve:app_missed_tokens",
            "Prompt tokens not served from a cache, per application and cause (first_seen, "
            "divergence, eviction, uncached, partial_block, salt; they sum to the misses).",
            ["app", "cause"],
            registry=registry,
        )
        self.breaks = Counter(
            "kvserve:cache_breaks",
            "Prompts whose cached prefix a small difference broke.",
            ["app"],
            registry=registry,
        )

    def label(self, name: str) -> str:
        if name in self.apps or len(self.apps) < MAX_APPS:
            return name
        return "other"

    def observe(
        self, name: str, prompt: list[int], hit: PrefixSummary, salt: str | None = None
    ) -> None:
        app = self.label(name)
        record = self.apps.setdefault(app, AppRecord())
        n = len(prompt)
        record.prompt_tokens += n
        record.cached_tokens += hit.cached
        record.hit_rates.append(hit.cached / n if n else 0.0)
        self.prompt_tokens.labels(app).inc(n)
        for tier in TIERS:
            if tokens := getattr(hit, tier):
                self.cached_tokens.labels(app, tier).inc(tokens)
        tokens = array("q", prompt[:MAX_SKETCH_TOKENS])
        bs = self.block_size()
        # each recent prompt's shared prefix, newest first (the newest wins a tie)
        shares = [
            (common_prefix(tokens, old), old, s == salt) for old, s in reversed(record.recent)
        ]
        shared, best = max(
            ((length, old) for length, old, same in shares if same),
            key=lambda share: share[0],
            default=(0, None),
        )
        brk = find_break(tokens, best, bs) if best is not None else None
        if brk is not None and hit.cached + hit.evicted > brk.position + bs:
            brk = None  # the hit reached past it: not what cost this prompt
        other_salt = max((length for length, _, same in shares if not same), default=0)
        causes = attribute_misses(n, hit, shared, brk, other_salt, bs)
        for cause, count in causes.items():
            if count:
                record.missed[cause] += count
                self.missed_tokens.labels(app, cause).inc(count)
        if brk is not None and best is not None:
            self.breaks.labels(app).inc()
            self._record_breaker(app, record, brk, tokens, best, causes["divergence"])
        record.recent.append((tokens, salt))

    def _record_breaker(
        self, app: str, record: AppRecord, brk: Break, new: array, old: array, lost: int
    ) -> None:
        p = brk.position
        key = p // self.block_size()  # one breaker per block it breaks (tokenizations vary)
        if key not in record.breakers and len(record.breakers) >= 64:  # keep the costliest
            cheapest = min(record.breakers, key=lambda k: record.breakers[k].lost_tokens)
            del record.breakers[cheapest]

        def show(tokens: array, span: int) -> str:
            before = self.decode(tokens[max(0, p - CONTEXT) : p].tolist())
            differ = self.decode(tokens[p : p + span].tolist())
            after = self.decode(tokens[p + span : p + span + CONTEXT].tolist())
            return f"{before}[{differ}]{after}"

        breaker = record.breakers.setdefault(key, Breaker(app, p, "", ""))
        breaker.position = p  # the latest occurrence
        breaker.new_text, breaker.old_text = show(new, brk.new_span), show(old, brk.old_span)
        breaker.count += 1
        breaker.lost_tokens += lost
        now = time.monotonic()
        if breaker.count >= 2 and now - breaker.last_logged >= LOG_EVERY_S:
            breaker.last_logged = now
            log.warning(
                "app %r: prompts differ at token %d (%r, before: %r) and then continue alike: "
                "%d tokens of prefill lost (%d times so far); keep changing text out of the "
                "prompt's shared beginning",
                app,
                p,
                breaker.new_text,
                breaker.old_text,
                lost,
                breaker.count,
            )

    def snapshot(self) -> dict:
        out = {}
        for app, r in self.apps.items():
            named = [b for b in r.breakers.values() if b.count >= 2]  # repeatedly, a block or more
            top = sorted(named, key=lambda b: -b.lost_tokens)[:TOP_BREAKERS]
            out[app] = {
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "hit_rate": r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0,
                "missed_tokens": dict(r.missed),
                "recent_hit_rates": [round(h, 3) for h in r.hit_rates],
                "breakers": [b.as_dict() for b in top],
            }
        return out
