"""A learner's two background threads: communication and syncer (mixed into Session).

- The *communication* thread publishes contributions, renews the lease (a task of its own,
  so a long transfer never starves it), and closes rounds this learner contributed to
  (``engine/closer.py``); a round it closes is staged for the training thread at once,
  before its events and its sweep.
- The *syncer* polls ``rounds/`` for new commits, downloads and stages them, record by
  record and fragment by fragment: one unreadable record is reported once and skipped, one
  failed download holds no other fragment back.

Each thread runs its own event loop; one mailbox instance serves both. The training thread
only ever sees what these loops stage (``_state._Staged``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.compression import Compression
from gradientmail.algorithms.contribution import encode_contribution
from gradientmail.coord.heartbeat import Heartbeat
from gradientmail.coord.leases import LeaseTracker
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.coord.threads import Wake
from gradientmail.engine.chain import commit_tensors, step_from_contributions
from gradientmail.engine.closer import RoundCloser
from gradientmail.engine.groups import GroupRounds
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ProtocolError
from gradientmail.events import Counters, Event, PollFailed, Published, PublishFailed, RoundFailed
from gradientmail.ledger import GLOBAL
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors
from gradientmail.payload.buffers import BufferPool
from gradientmail.payload.stream import read_into
from gradientmail.session._state import _TICK, _log_event, _Pending, _poll_delay, _Staged


class _Background:
    """The background loops of :class:`~gradientmail.session.Session`; the state they share
    with the training thread is declared here and set up by the Session."""

    learner_id: str
    algorithm: Algorithm
    poll_interval: float
    idle_poll_interval: float
    _box: Mailbox
    _closer: RoundCloser
    _closer_events: list[Event]
    _layout: ModelLayout
    _globals: BufferPool
    _ref: list[dict[str, torch.Tensor]]
    _tracker: LeaseTracker
    _heartbeat: Heartbeat
    _lock: threading.Lock
    _changed: threading.Event
    _stop: threading.Event
    _counters: Counters
    _wake_sync: Wake
    _wake_comm: Wake
    _wake_beat: Wake
    _outbox: deque[_Pending]
    _inflight: dict[int, _Pending]
    _staged: dict[int, _Staged]
    _known: list[int]
    _bad: set[str]
    _fragments: int
    events: deque[Event]
    _on_event: Callable[[Event], None] | None
    _optimizer: torch.optim.Optimizer | None
    _resume_uploads: Callable[[], Coroutine[Any, Any, None]]  # the Session's (_resume.py)
    _compression: tuple[Compression, float] | None  # (compressor, error decay), if any
    _residual: list[dict[str, torch.Tensor] | None]  # error feedback per fragment
    # Compressed, stateless rounds: commits are computed from their contributions (_replay)
    # from the last one staged per fragment (round, parameters), kept under _lock.
    _delta_downloads: bool
    _last_commit: list[tuple[int, dict[str, torch.Tensor]]]
    _wake_save: Wake
    _groups: GroupRounds | None  # a Moshpit run's group rounds (session/_groups.py)

    def _thread_main(self, loop: Callable[[], object]) -> None:
        async def main() -> None:
            await loop()  # type: ignore[misc]

        asyncio.run(main())

    async def _pause(self, seconds: float, wake: Wake | None = None) -> bool:
        """Sleep ``seconds``, or less when stopped or woken; True when ``wake`` ended it."""
        end = time.monotonic() + seconds
        while not self._stop.is_set() and (left := end - time.monotonic()) > 0:
            if wake is not None:
                if wake.consume():
                    return True
                await wake.wait(min(left, 0.05))
            else:
                await asyncio.sleep(min(left, 0.05))
        return wake is not None and wake.consume()

    def _emit(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)
        self._changed.set()
        _log_event(event)
        if self._on_event is not None:
            with contextlib.suppress(Exception):  # a broken callback must not stop the session
                self._on_event(event)

    async def _communicate(self) -> None:
        # Beats run as a task of their own: a long publish or close on this loop would
        # otherwise make a healthy learner look dead, and others would repeat its close.
        beats = asyncio.create_task(
            self._heartbeat.run(
                self._stop,
                lambda exc: self._emit(PollFailed(self.learner_id, error=f"beat: {exc!r}")),
                wake=self._wake_beat,
            )
        )
        # Resume saves too (Session(optimizer=...)): a large upload of the optimizer's state
        # must not hold back a contribution. Not cancelled when stopped: a save in progress
        # finishes (or gives up at its first failure), so no payload is left unnamed.
        saves = None if self._optimizer is None else asyncio.create_task(self._resume_uploads())
        try:
            await self._communicate_loop()
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError, Stopped):
                await beats
            if saves is not None:
                self._wake_save.set()  # its idle wait ends at once
                await saves

    async def _communicate_loop(self) -> None:
        next_check = 0.0
        while not self._stop.is_set():
            try:
                while True:
                    with self._lock:
                        pending = self._outbox.popleft() if self._outbox else None
                    if pending is None:
                        break
                    if self._groups is not None:
                        await self._group_publish(pending)  # type: ignore[attr-defined]
                    else:
                        await self._publish(pending)
                    self._wake_sync.set()  # from now on the syncer polls at the fast rate
                    next_check = 0.0  # a new snapshot may complete a round: look now
                with self._lock:
                    open_rounds = [x for x in self._inflight.values() if x.payload is not None]
                if open_rounds and time.monotonic() >= next_check:
                    now = time.monotonic()
                    delay = self.poll_interval
                    if self._groups is not None:
                        # A Moshpit learner has no syncer: this loop is what finds its
                        # group's commit, so it looks as the syncer does, fast right after
                        # publishing, backing off in proportion to the wait.
                        since = min(x.published_at or now for x in open_rounds)
                        delay = _poll_delay(now - since, self.poll_interval)
                    next_check = now + delay
                    leases = await retrying(partial(self._box.list, p.LEASES), stop=self._stop)
                    self._tracker.observe(leases)
                    for pending in open_rounds:
                        if self._groups is not None:
                            await self._group_close(pending)  # type: ignore[attr-defined]
                        else:
                            await self._close(pending)
            except Stopped:
                return
            except Exception as exc:
                self._emit(PollFailed(self.learner_id, error=f"communication: {exc!r}"))
            await self._pause(_TICK, wake=self._wake_comm)

    async def _publish(self, pending: _Pending) -> None:
        with self._lock:  # applying its round lets go of the snapshot, under the lock
            if pending.cancelled:
                return
            snapshot = pending.snapshot
            base_params = pending.base_params
            residual = self._residual[pending.fragment]
        try:
            if self._compression is not None:
                # Here, never on the training thread. The residual this learner keeps
                # changes only when the commit holding this contribution is applied
                # (_training.py): a contribution that misses its round leaves it as it was.
                compression, decay = self._compression
                snapshot, pending.residual = await asyncio.to_thread(
                    encode_contribution,
                    compression,
                    decay,
                    snapshot,
                    base_params,
                    residual,
                    self._layout.buffer_names(pending.fragment),
                )
                pending.compressed = snapshot
            key, nbytes = await retrying(partial(put_tensors, self._box, snapshot), stop=self._stop)
            record = p.Snapshot(pending.round, self.learner_id, pending.samples, key, pending.base)
            await retrying(
                partial(
                    self._box.put_if_absent,
                    p.snapshot_key(pending.round, self.learner_id),
                    p.encode(record),
                ),
                stop=self._stop,
            )
        except Stopped:
            raise
        except Exception as exc:
            self._emit(PublishFailed(self.learner_id, round=pending.round, error=repr(exc)))
            with self._lock:
                if self._inflight.get(pending.fragment) is pending:
                    del self._inflight[pending.fragment]
            return
        with self._lock:
            if pending.cancelled:
                # Its round was committed (and applied) while this upload ran: counted as
                # a sync point passed uncontributed by the training thread, not published.
                return
            pending.payload = key
            pending.published_at = time.monotonic()
            self._counters.published += 1
        # A beat now: it carries the counters (status shows contributions as they happen,
        # not up to a beat interval later).
        self._wake_beat.set()
        self._emit(
            Published(
                self.learner_id,
                round=pending.round,
                fragment=pending.fragment,
                samples=pending.samples,
                nbytes=nbytes,
            )
        )

    async def _close(self, pending: _Pending) -> None:
        with self._lock:
            if pending.cancelled or pending.round <= self._known[pending.fragment]:
                return
            # Held here: applying the round lets go of them (under the lock) meanwhile.
            # A compressed contribution is summed from its payload's tensors, as the others'.
            snapshot, base_params = pending.compressed or pending.snapshot, pending.base_params
        assert pending.payload is not None
        failure: Exception | None = None
        outcome = None
        try:
            outcome = await self._closer.try_close(
                pending.round, pending.payload, snapshot, base_params
            )
        except Stopped:
            raise
        except Exception as exc:
            failure = exc
        if outcome is not None:
            with self._lock:
                self._counters.closed += 1
            if outcome.params is not None:
                # Staged here, before the sweep, the events and without a download: the
                # training thread (perhaps waiting at the sync point) applies it at once.
                # Staging marks the round known: neither the next tick nor the syncer
                # closes or fetches it again.
                self._stage(outcome.commit, outcome.params)
            self._wake_sync.set()  # the record is written: the syncer looks now
        events, self._closer_events[:] = list(self._closer_events), []
        for event in events:
            self._emit(event)
        if failure is not None:
            self._emit(RoundFailed(self.learner_id, round=pending.round, error=repr(failure)))
        if outcome is None:
            return
        if outcome.params is not None:
            try:
                await self._closer.sweep(outcome.commit)
            except Stopped:
                raise
            except Exception as exc:  # sweeping is housekeeping; the round is committed
                self._emit(
                    RoundFailed(self.learner_id, round=pending.round, error=f"sweep: {exc!r}")
                )

    def _stage(self, commit: p.Commit, params: dict[str, torch.Tensor]) -> bool:
        """Hand a verified commit to the training thread; False when it is not newer than
        what is already known for its fragment."""
        fragment = commit.fragment
        mine = frozenset(
            (commit.round, x.payload) for x in commit.contributors if x.learner == self.learner_id
        )
        item = _Staged(commit, params, mine)
        with self._lock:
            if commit.round <= self._known[fragment]:
                return False
            older = self._staged.get(fragment)
            self._staged[fragment] = item if older is None else item.merged(older)
            self._known[fragment] = commit.round
            if self._delta_downloads:
                self._last_commit[fragment] = (commit.round, params)
        self._changed.set()
        return True

    async def _replay(
        self, fragment: int, commits: list[p.Commit]
    ) -> dict[str, torch.Tensor] | None:
        """The newest of ``commits`` computed from their rounds' compressed contributions,
        starting from the last commit of ``fragment`` this learner staged (each round must
        build on the one before); None when that is not possible here (a gap, a payload
        that fails, a result whose hash is not the record's: all reported, then the
        parameters are downloaded)."""
        with self._lock:
            known, params = self._last_commit[fragment]
        specs = self._layout.specs[fragment]
        for commit in commits:
            if commit.round <= known:
                continue
            if commit.base != known or not params:
                return None  # this learner missed a round (it joined, or was away)
            with self._lock:
                pending = self._inflight.get(fragment)
                own = (
                    (pending.payload, pending.compressed)
                    if pending is not None
                    and pending.payload is not None
                    and pending.compressed is not None
                    else None
                )
            try:
                params = await retrying(
                    partial(
                        step_from_contributions,
                        self._box,
                        self.algorithm,
                        specs,
                        commit,
                        params,
                        own,
                        self._globals.take(params),
                    ),
                    stop=self._stop,
                )
            except ProtocolError as exc:
                self._emit(
                    PollFailed(
                        self.learner_id,
                        error=f"round {commit.round}: cannot compute it from its "
                        f"contributions ({exc}); loading its parameters instead",
                    )
                )
                return None
            known = commit.round
        return params if known == commits[-1].round else None

    async def _sync(self) -> None:
        since = time.monotonic()  # when this learner last published (woke the syncer)
        while not self._stop.is_set():
            try:
                await self._poll_rounds()
            except Stopped:
                return
            except Exception as exc:
                self._emit(PollFailed(self.learner_id, error=f"rounds: {exc!r}"))
            # Adaptive polling: fast while this learner waits for a commit of its own, slow
            # when idle (a commit it did not contribute to can wait a few seconds).
            with self._lock:
                waiting = bool(self._inflight)
            # While waiting, start fast after a publish (the commit may land within tens of
            # milliseconds) and back off in proportion to the wait, up to poll_interval;
            # idle, poll at idle_poll_interval.
            if waiting:
                interval = _poll_delay(time.monotonic() - since, self.poll_interval)
            else:
                interval = self.idle_poll_interval
            if await self._pause(interval, wake=self._wake_sync):
                since = time.monotonic()

    async def _poll_rounds(self) -> None:
        # Rounds of different fragments can commit out of order; listing after the oldest
        # per-fragment cursor never skips one.
        with self._lock:
            cursor = p.round_key(min(self._known))
        keys = await retrying(partial(self._box.list, p.ROUNDS, after=cursor), stop=self._stop)
        fresh: dict[int, list[p.Commit]] = {}
        for key in keys:
            if key in self._bad:
                continue
            # Record by record: one unreadable record (or a stray key under rounds/, a
            # tool's temporary file, a console's folder marker) is reported once and
            # skipped; it must not stop this poll, or every later one, for every fragment.
            try:
                r = p.parse_round_key(key)
            except ProtocolError as exc:
                self._bad.add(key)
                self._emit(PollFailed(self.learner_id, error=f"skipping a key: {exc}"))
                continue
            fragment = r % self._fragments
            with self._lock:
                if r <= self._known[fragment]:
                    continue
            try:
                data = await retrying(partial(self._box.get, key), stop=self._stop)
                commit = p.decode_commit(key, data)
                if commit.fragment != fragment:
                    raise ProtocolError(f"{key}: fragment {commit.fragment}, expected {fragment}")
            except ProtocolError as exc:
                self._bad.add(key)
                self._emit(PollFailed(self.learner_id, error=f"skipping round record: {exc}"))
                continue
            fresh.setdefault(fragment, []).append(commit)
        for fragment, commits in fresh.items():
            # Fragment by fragment: a failed download of one holds no other back.
            try:
                await self._fetch(fragment, commits)
            except Stopped:
                raise
            except Exception as exc:
                self._emit(
                    PollFailed(
                        self.learner_id,
                        error=f"round {commits[-1].round} (fragment {fragment}): {exc!r}",
                    )
                )

    async def _fetch(self, fragment: int, commits: list[p.Commit]) -> None:
        """Download the newest of ``commits`` (one fragment's, oldest first) and stage it,
        remembering which of them held this learner's contributions. With compressed,
        stateless rounds (SparseLoCo) the commits are computed here from the rounds'
        compressed contributions and the commit this learner had, as their closers did;
        the parameters are downloaded only when that cannot be done."""
        newest = commits[-1]
        specs = self._layout.specs[fragment]
        like = self._ref[fragment]
        params = await self._replay(fragment, commits) if self._delta_downloads else None
        if params is not None:
            with self._lock:
                self._counters.computed += 1
        elif not newest.stored:  # computed along its chain (engine/chain.py)
            params = await commit_tensors(self._box, self.algorithm, specs, newest, purpose=GLOBAL)
        elif like.keys() == {spec.name for spec in specs}:
            # Streamed part by part into a pooled buffer: the download holds a few parts,
            # and the buffer a previous commit of any fragment released.
            into = self._globals.take(like, dtype=None)
            params = await read_into(self._box, newest.params, specs, into, stop=self._stop)
        else:
            params = await retrying(
                partial(get_tensors, self._box, newest.params, specs, purpose=GLOBAL),
                stop=self._stop,
            )
        mine = frozenset(
            (c.round, x.payload)
            for c in commits
            for x in c.contributors
            if x.learner == self.learner_id
        )
        item = _Staged(newest, params, mine)
        with self._lock:
            if newest.round <= self._known[fragment]:
                return  # staged meanwhile by this learner's own close
            older = self._staged.get(fragment)
            self._staged[fragment] = item if older is None else item.merged(older)
            self._known[fragment] = newest.round
            if self._delta_downloads:
                self._last_commit[fragment] = (newest.round, params)
        for c in commits:
            self._closer.forget(c.round)
        self._changed.set()
