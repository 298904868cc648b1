"""A lease renewed by heartbeats: ``{prefix}{learner}/{beat:010d}``, newest key wins.

One implementation for every holder of a lease: a Session's (``leases/``, a JSON
:class:`~gradientmail.wire.Beat` with its counters) and a Shared Queue's
(``units-leases/``, the learner ID). Observers judge liveness from the keys alone
(:class:`~gradientmail.coord.leases.LeaseTracker`), never from a server clock.

- :meth:`Heartbeat.start` resumes a learner's earlier life: its stale beats go (the
  leaving beat of a previous life first, or it would read as gone for good) and the
  numbers continue after the newest. It cannot tell an earlier life from another process
  beating as the same learner right now: whoever must (a Session) asks
  :func:`~gradientmail.coord.leases.beating` first.
- :meth:`Heartbeat.run` is a task of its own: a long transfer on the same event loop
  never starves it (a learner that looked dead would have its rounds closed by others).
- Old beats are deleted in batches, one request per eight beats: an idle learner's
  request rate shows on an S3 bill.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from functools import partial

from gradientmail.coord.retry import Stopped, retrying
from gradientmail.coord.threads import Wake
from gradientmail.mailbox import Mailbox
from gradientmail.wire import LEAVING_BEAT

__all__ = ["Heartbeat"]

_WIDTH = 10  # beat numbers in keys; LEAVING_BEAT is the largest
_SWEEP_EVERY = 8


class Heartbeat:
    """Beats of ``learner`` under ``prefix``; ``record(leaving)`` is each beat's bytes."""

    def __init__(
        self,
        box: Mailbox,
        prefix: str,
        learner: str,
        record: Callable[[bool], bytes],
        interval: float,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"the beat interval must be positive, not {interval!r}")
        self.box = box
        self.prefix = prefix
        self.learner = learner
        self.record = record
        self.interval = interval
        self.number = -1  # the next beat's number; -1 until started
        self._oldest = 0  # the oldest beat not yet deleted

    def key(self, number: int) -> str:
        return f"{self.prefix}{self.learner}/{number:0{_WIDTH}d}"

    async def start(self, *, deadline: float | None = None) -> None:
        """Continue after this learner's newest beat (of any earlier life) and beat."""
        own_prefix = f"{self.prefix}{self.learner}/"
        own = await retrying(partial(self.box.list, own_prefix), deadline=deadline)
        numbers = sorted(
            int(key[len(own_prefix) :]) for key in own if key[len(own_prefix) :].isdigit()
        )
        newest = max((n for n in numbers if n != LEAVING_BEAT), default=-1)
        stale = [self.key(n) for n in numbers if n != newest]
        if stale:  # beats of a previous life, the leaving beat among them
            await retrying(partial(self.box.delete, stale), deadline=deadline)
        self.number = newest + 1
        self._oldest = max(newest, 0)
        await self.beat(deadline=deadline)

    async def beat(
        self, *, deadline: float | None = None, stop: threading.Event | None = None
    ) -> None:
        """Write the next beat (a lost response's retry finds its own beat: fine)."""
        number = self.number
        await retrying(
            partial(self.box.put_if_absent, self.key(number), self.record(False)),
            stop=stop,
            deadline=deadline,
        )
        self.number += 1
        # Keep the newest two beats; delete older ones in batches.
        if number - self._oldest > _SWEEP_EVERY:
            old = [self.key(n) for n in range(self._oldest, number - 1)]
            await retrying(partial(self.box.delete, old), stop=stop, deadline=deadline)
            self._oldest = number - 1

    async def run(
        self,
        stop: threading.Event,
        on_error: Callable[[Exception], None],
        *,
        give_up: bool = False,
        clock: Callable[[], float] | None = None,
        wake: Wake | None = None,
    ) -> None:
        """Beat every ``interval`` seconds until ``stop`` is set; a failure goes to
        ``on_error`` and the next beat is tried on time. ``give_up``: a beat is retried
        for one interval at most (on ``clock``), and the first failure ends the loop.
        ``wake``: beat at once when raised (news worth showing: a beat carries counters)."""
        while not stop.is_set():
            await _pause(stop, self.interval, wake)
            if stop.is_set():
                return
            deadline = None if not give_up or clock is None else clock() + self.interval
            try:
                await self.beat(stop=stop, deadline=deadline)
            except Stopped:
                return
            except Exception as exc:
                on_error(exc)
                if give_up:
                    return

    async def leave(self, *, deadline: float | None = None) -> None:
        """The leaving beat: observers count this learner gone at once."""
        await retrying(
            partial(self.box.put_if_absent, self.key(LEAVING_BEAT), self.record(True)),
            deadline=deadline,
        )


async def _pause(stop: threading.Event, seconds: float, wake: Wake | None = None) -> None:
    """Sleep ``seconds`` in slices, returning early once ``stop`` is set or ``wake`` raised."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not stop.is_set() and (left := end - loop.time()) > 0:
        if wake is None:
            await asyncio.sleep(min(left, 0.05))
        elif wake.consume():
            return
        else:
            await wake.wait(min(left, 0.05))
