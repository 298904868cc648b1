"""A learner's background threads: communication and, where its exchange has one, the
syncer. Each runs its own event loop; one mailbox instance serves both, and the training
thread only ever sees what they stage (``_state.Shared.stage``).

- The *communication* thread takes the contributions ``step()`` handed over (the
  outbox), publishes each through the exchange, renews the lease (a task of its own, so
  a long transfer never starves it), stores resume saves (another task), and on every
  tick asks the exchange to close the rounds this learner has in flight.
- The *syncer* asks the exchange to look for commits: fast while this learner waits for
  one of its own, slow when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from gradientmail import wire as p
from gradientmail.coord.heartbeat import Heartbeat
from gradientmail.coord.leases import LeaseTracker
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.coord.threads import Wake
from gradientmail.engine.exchange import Exchange, Offer, Pending
from gradientmail.events import PollFailed, Published, PublishFailed
from gradientmail.mailbox import Mailbox
from gradientmail.session._resume import Resume
from gradientmail.session._state import _TICK, Shared, _poll_delay


class Communication:
    """The background loops of one learner (module docstring)."""

    def __init__(
        self,
        shared: Shared,
        exchange: Exchange,
        box: Mailbox,
        tracker: LeaseTracker,
        heartbeat: Heartbeat,
        resume: Resume,
        *,
        poll_interval: float,
        idle_poll_interval: float,
    ) -> None:
        self.shared = shared
        self.exchange = exchange
        self.box = box
        self.tracker = tracker
        self.heartbeat = heartbeat
        self.resume = resume
        self.poll_interval = poll_interval
        self.idle_poll_interval = idle_poll_interval

    def threads(self) -> list[threading.Thread]:
        """The threads to start: communication, and the syncer where the exchange has one
        (a Moshpit learner's group commits come to its communication thread)."""
        loops: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
            ("comm", self._communicate)
        ]
        if self.exchange.syncer:
            loops.append(("sync", self._sync))
        learner = self.shared.learner_id
        return [
            threading.Thread(
                target=asyncio.run, args=(loop(),), name=f"gm-{name}-{learner}", daemon=True
            )
            for name, loop in loops
        ]

    async def _pause(self, seconds: float, wake: Wake) -> bool:
        """Sleep ``seconds``, or less when stopped or woken; True when ``wake`` ended it."""
        end = time.monotonic() + seconds
        while not self.shared.stop.is_set() and (left := end - time.monotonic()) > 0:
            if wake.consume():
                return True
            await wake.wait(min(left, 0.05))
        return wake.consume()

    # -- the communication thread -------------------------------------------------------------

    async def _communicate(self) -> None:
        shared = self.shared
        # Beats run as a task of their own: a long publish or close on this loop would
        # otherwise make a healthy learner look dead, and others would repeat its close.
        beats = asyncio.create_task(
            self.heartbeat.run(
                shared.stop,
                lambda exc: shared.emit(PollFailed(shared.learner_id, error=f"beat: {exc!r}")),
                wake=shared.wake_beat,
            )
        )
        # Resume saves too (Session(optimizer=...)): a large upload of the optimizer's state
        # must not hold back a contribution. Not cancelled when stopped: a save in progress
        # finishes (or gives up at its first failure), so no payload is left unnamed.
        saves = None
        if self.resume.optimizer is not None:
            saves = asyncio.create_task(self.resume.uploads())
        try:
            await self._communicate_loop()
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError, Stopped):
                await beats
            if saves is not None:
                self.resume.wake.set()  # its idle wait ends at once
                await saves

    async def _communicate_loop(self) -> None:
        shared = self.shared
        next_check = 0.0
        while not shared.stop.is_set():
            try:
                while True:
                    with shared.lock:
                        pending = shared.outbox.popleft() if shared.outbox else None
                    if pending is None:
                        break
                    await self._publish(pending)
                    shared.wake_sync.set()  # from now on the syncer polls at the fast rate
                    next_check = 0.0  # a new snapshot may complete a round: look now
                with shared.lock:
                    open_rounds = [x for x in shared.inflight.values() if x.payload is not None]
                if open_rounds and time.monotonic() >= next_check:
                    now = time.monotonic()
                    delay = self.poll_interval
                    if not self.exchange.syncer:
                        # Without a syncer this loop is what finds the commit: it looks as
                        # the syncer does, fast right after publishing, backing off in
                        # proportion to the wait.
                        since = min(x.published_at or now for x in open_rounds)
                        delay = _poll_delay(now - since, self.poll_interval)
                    next_check = now + delay
                    leases = await retrying(partial(self.box.list, p.LEASES), stop=shared.stop)
                    self.tracker.observe(leases)
                    for pending in open_rounds:
                        await self.exchange.close(pending)
            except Stopped:
                return
            except Exception as exc:
                shared.emit(PollFailed(shared.learner_id, error=f"communication: {exc!r}"))
            await self._pause(_TICK, shared.wake_comm)

    async def _publish(self, pending: Pending) -> None:
        """Publish one contribution through the exchange, and tell the training thread
        (and the counters, the beat, the events) where it went."""
        shared = self.shared
        with shared.lock:  # applying its round lets go of the tensors, under the lock
            if pending.cancelled:
                return
            offer = Offer(
                pending.round,
                pending.fragment,
                pending.base,
                pending.samples,
                pending.snapshot,
                pending.base_params,
                shared.residual[pending.fragment],
            )
        try:
            placed = await self.exchange.publish(offer)
        except Stopped:
            raise
        except Exception as exc:
            shared.emit(PublishFailed(shared.learner_id, round=pending.round, error=repr(exc)))
            with shared.lock:
                if shared.inflight.get(pending.fragment) is pending:
                    del shared.inflight[pending.fragment]
            return
        with shared.lock:
            if pending.cancelled:
                # Its round was committed (and applied) while this upload ran: counted as
                # a sync point passed uncontributed by the training thread, not published.
                return
            pending.round, pending.group = placed.round, placed.group
            pending.payload = placed.payload
            pending.compressed, pending.residual = placed.compressed, placed.residual
            pending.published_at = time.monotonic()
            shared.counters.published += 1
        # A beat now: it carries the counters (status shows contributions as they happen,
        # not up to a beat interval later).
        shared.wake_beat.set()
        shared.emit(
            Published(
                shared.learner_id,
                round=placed.round,
                fragment=pending.fragment,
                samples=pending.samples,
                nbytes=placed.nbytes,
            )
        )

    # -- the syncer thread --------------------------------------------------------------------

    async def _sync(self) -> None:
        shared = self.shared
        since = time.monotonic()  # when this learner last published (woke the syncer)
        while not shared.stop.is_set():
            try:
                await self.exchange.poll()
            except Stopped:
                return
            except Exception as exc:
                shared.emit(PollFailed(shared.learner_id, error=f"rounds: {exc!r}"))
            # Adaptive polling: fast while this learner waits for a commit of its own, slow
            # when idle (a commit it did not contribute to can wait a few seconds).
            with shared.lock:
                waiting = bool(shared.inflight)
            # While waiting, start fast after a publish (the commit may land within tens of
            # milliseconds) and back off in proportion to the wait, up to poll_interval;
            # idle, poll at idle_poll_interval.
            if waiting:
                interval = _poll_delay(time.monotonic() - since, self.poll_interval)
            else:
                interval = self.idle_poll_interval
            if await self._pause(interval, shared.wake_sync):
                since = time.monotonic()
