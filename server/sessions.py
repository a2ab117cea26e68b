"""Chat sessions, keyed by the request's `user` field or an `X-Session-ID` header: the token
history of each session's last turn, so a new turn can report how much of it the chat template
kept (prefix-cache reuse ends at the first token the template rendered differently)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.images import PromptImage

log = logging.getLogger("kvserve.sessions")


@dataclass(slots=True)
class Session:
    token_ids: list[int]
    last_seen: float
    cache_salt: str | None = None
    offloaded: bool = False
    images: tuple[PromptImage, ...] = ()  # its prompt's (their content hashes key its blocks)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SessionTracker:
    def __init__(self, max_sessions: int = 4096) -> None:
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, Session] = OrderedDict()

    def begin_turn(self, session_id: str | None, prompt_ids: list[int]) -> int | None:
        """Log how far the new prompt follows the session's previous turn; returns that length."""
        if not session_id or session_id not in self.sessions:
            return None
        previous = self.sessions[session_id].token_ids
        same = common_prefix(previous, prompt_ids)
        if same < len(previous):
            log.debug(
                "session %s: template re-rendered history; %d of the previous turn's %d tokens "
                "kept, %d diverged",
                session_id,
                same,
                len(previous),
                len(previous) - same,
            )
        return same

    def end_turn(
        self,
        session_id: str | None,
        token_ids: list[int],
        cache_salt: str | None = None,
        images: tuple[PromptImage, ...] = (),
    ) -> None:
        if not session_id:
            return
        self.sessions[session_id] = Session(
            list(token_ids),
            time.monotonic(),
            cache_salt,
            images=tuple(image.identity() for image in images),  # not their pixels
        )
        self.sessions.move_to_end(session_id)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)

    def idle(self, idle_seconds: float) -> list[tuple[str, Session]]:
        """Sessions idle longer than idle_seconds whose KV has not been offloaded yet."""
        now = time.monotonic()
        return [
            (sid, s)
            for sid, s in self.sessions.items()
            if not s.offloaded and now - s.last_seen >= idle_seconds
        ]
