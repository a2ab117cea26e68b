"""When the tiers log a failure that repeats (a full disk fails every save, a store that is down
fails every put, a bad writer's values fail every read): the 1st, 2nd, 4th, 8th... occurrence,
so one line per block does not flood the log and a failure that keeps coming stays visible."""

from __future__ import annotations


def should_log(count: int) -> bool:
    """Whether the `count`-th occurrence (from 1) is logged."""
    return count & (count - 1) == 0
