"""Liveness without clocks: who is alive, judged from beat keys on the observer's clock.

A learner writes ``leases/{learner}/{beat}`` with an increasing beat number every few
seconds. An observer lists ``leases/`` and remembers, per learner, the newest beat key and
the moment (its own monotonic clock) when that key last changed. A learner is live while
its newest beat changed within ``lease_timeout`` seconds and is not the leaving beat. No
server timestamp is ever read, so skewed clocks between machines do not matter.

A learner first seen with an old beat is given the benefit of the doubt for one
``lease_timeout``: the observer cannot know how old the beat is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gradientmail.errors import ProtocolError
from gradientmail.wire import LEAVING_BEAT, parse_beat_key

__all__ = ["LearnerLease", "LeaseTracker"]


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
