"""Liveness without clocks: who is alive, judged from beat keys on the observer's clock.

A learner writes ``leases/{learner}/{beat}`` with an increasing beat number every few
seconds. An observer lists ``leases/`` and remembers, per learner, the newest beat key and
the moment (its own monotonic clock) when that key last changed. A learner is live while
its newest beat changed within ``lease_timeout`` seconds and is not the leaving beat. No
server timestamp is ever read, so skewed clocks between machines do not matter.

A learner first seen with an old beat is given the benefit of the doubt for one
``lease_timeout``: the observer cannot know how old the beat is.

:func:`beating` answers a narrower question without that benefit of the doubt: is anyone
beating as these learners *now*? It watches their newest beats for a bit more than one
beat interval; a beat that advances meanwhile is a live holder of the id. A crashed
learner's last beat looks live for a whole ``lease_timeout`` but never advances, so a
restart (the same id) can tell its own earlier life from another process that holds the
id, at the cost of one watch (:data:`WATCH_BEATS` beat intervals) when the earlier life
did not leave.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import partial

from gradientmail.coord.retry import retrying
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.wire import LEASES, LEAVING_BEAT, lease_prefix, parse_beat_key

__all__ = [
    "DEFAULT_LEASE_TIMEOUT",
    "WATCH_BEATS",
    "Beating",
    "LearnerLease",
    "LeaseTracker",
    "beating",
]

DEFAULT_LEASE_TIMEOUT = 15.0
"""Session's default ``lease_timeout``: its beat interval is a third of it."""

WATCH_BEATS = 1.5
"""How many beat intervals :func:`beating` watches a learner's newest beat for a change."""


@dataclass(frozen=True)
class LearnerLease:
    learner: str
    beat: int
    changed_at: float  # observer's monotonic clock
    leaving: bool


class LeaseTracker:
    """Turns successive listings of ``leases/`` into a live set. Thread-safe."""

    def __init__(self, lease_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_timeout <= 0:
            raise ValueError(f"lease_timeout must be positive, not {lease_timeout}")
        self.lease_timeout = lease_timeout
        self._clock = clock
        self._leases: dict[str, LearnerLease] = {}
        self._lock = threading.Lock()

    def observe(self, keys: Iterable[str]) -> None:
        """Feed one complete listing of ``leases/``."""
        newest: dict[str, int] = {}
        for key in keys:
            try:
                learner, beat = parse_beat_key(key)
            except ProtocolError:
                continue  # not a beat (someone else's object): ignore rather than fail
            newest[learner] = max(beat, newest.get(learner, -1))
        now = self._clock()
        with self._lock:
            for learner, beat in newest.items():
                known = self._leases.get(learner)
                if known is None or known.beat != beat:
                    self._leases[learner] = LearnerLease(learner, beat, now, beat == LEAVING_BEAT)

    def live(self) -> set[str]:
        now = self._clock()
        with self._lock:
            return {
                lease.learner
                for lease in self._leases.values()
                if not lease.leaving and now - lease.changed_at <= self.lease_timeout
            }

    def is_live(self, learner: str) -> bool:
        return learner in self.live()

    def known(self) -> dict[str, LearnerLease]:
        with self._lock:
            return dict(self._leases)


@dataclass(frozen=True)
class Beating:
    """A learner seen beating: its newest beat advanced ``age`` seconds ago (observer's
    clock) to number ``beat``."""

    learner: str
    beat: int
    age: float

    def describe(self) -> str:
        return f"{self.learner} (beat {self.beat}, {self.age:.1f} s ago)"


def _newest(keys: Iterable[str], learners: frozenset[str]) -> dict[str, int]:
    newest: dict[str, int] = {}
    for key in keys:
        try:
            learner, beat = parse_beat_key(key)
        except ProtocolError:
            continue  # not a beat: ignore, as LeaseTracker does
        if learner in learners:
            newest[learner] = max(beat, newest.get(learner, -1))
    return newest


async def beating(
    box: Mailbox,
    learners: Iterable[str],
    interval: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    poll: float | None = None,
    deadline: float | None = None,
    watching: Callable[[list[str], float], None] | None = None,
) -> dict[str, Beating]:
    """The ``learners`` someone is beating as right now, judged from the keys alone.

    A learner without beats, or whose newest beat is the leaving beat, is not beating (and
    costs one listing). Any other is watched for ``WATCH_BEATS * interval`` seconds on
    ``clock`` (``interval``: the holders' beat interval), listing every ``poll`` seconds
    (default a tenth of ``interval``); one whose newest beat changes to another beat
    meanwhile is beating. The watch ends early once every watched learner was seen beating.
    ``deadline`` (on ``clock``) bounds the retries of a store that fails; ``watching`` is
    told the learners about to be watched and for how long (a command says why it waits).
    """
    if interval <= 0:
        raise ValueError(f"the beat interval must be positive, not {interval!r}")
    wanted = frozenset(learners)
    if not wanted:
        return {}
    prefix = lease_prefix(next(iter(wanted))) if len(wanted) == 1 else LEASES
    pause = interval / 10 if poll is None else poll

    async def look() -> dict[str, int]:
        keys = await retrying(
            partial(box.list, prefix), deadline=deadline, clock=clock, sleep=sleep
        )
        return _newest(keys, wanted)

    first = await look()
    watched = {learner: beat for learner, beat in first.items() if beat != LEAVING_BEAT}
    seen: dict[str, tuple[int, float]] = {}  # learner -> (its new beat, when it was seen)
    left: set[str] = set()  # wrote its leaving beat while watched: not beating any more
    if watched and watching is not None:
        watching(sorted(watched), WATCH_BEATS * interval)
    end = clock() + WATCH_BEATS * interval
    while len(seen) + len(left) < len(watched) and clock() < end:
        await sleep(pause)
        newest = await look()
        now = clock()
        for learner, before in watched.items():
            beat = newest.get(learner, before)
            if learner in seen or learner in left or beat == before:
                continue
            if beat == LEAVING_BEAT:
                left.add(learner)
            else:
                seen[learner] = (beat, now)
    now = clock()
    return {
        learner: Beating(learner, beat, max(0.0, now - at))
        for learner, (beat, at) in sorted(seen.items())
    }
