"""The training-thread side of a Session (mixed into it): sync points, bounded waits for
commits, contributions at close()/sync(), and applying staged commits to the model.

Everything here runs on the thread that calls ``step()``, so the model's parameters change
only between optimizer steps; the lock guards what the background threads also touch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from gradientmail.algorithms.base import Algorithm
from gradientmail.coord.threads import Wake
from gradientmail.engine.layout import ModelLayout
from gradientmail.events import Applied, Counters, Event, SyncSkipped, SyncWaited
from gradientmail.payload.buffers import BufferPool
from gradientmail.session._state import _Pending, _Staged

_CONTRIBUTE_PASSES = 3  # close()/sync(): tries of a contribution that missed its round
_NEVER = 1 << 62  # a step number no run reaches: "no wait due"


class _TrainingSide:
    """The Session's training-thread methods; its state is set up by the Session."""

    learner_id: str
    algorithm: Algorithm
    overlap: int
    mixing: float | None
    free_running: bool
    wait_timeout: float
    _layout: ModelLayout
    _fragments: int
    _lock: threading.Lock
    _changed: threading.Event
    _counters: Counters
    _wake_comm: Wake
    _snapshots: BufferPool
    _steps: int
    _samples: int
    _counted: list[int]
    _contributed_at: list[int]
    _wait_at: int
    _waiting_since: float | None
    _applied: list[int]
    _ref: list[dict[str, torch.Tensor]]
    _inflight: dict[int, _Pending]
    _outbox: deque[_Pending]
    _staged: dict[int, _Staged]
    _residual: list[dict[str, torch.Tensor] | None]

    _emit: Callable[[Event], None]  # the Session's (its background side defines it)

    def _schedule_phase(self, rounds: dict[int, int]) -> int:
        """Where this learner's sync schedule starts, so that its first contribution goes
        to the round the others are in: the fragment whose next round comes first.

        A learner that joins (or rejoins) a run in progress counts its steps from 0. Had it
        started with fragment 0 whatever the run was doing, it could wait in fragment 0's
        round for the others while they waited in fragment 1's round for it: with every
        live learner awaited, both rounds then close only at ``round_timeout``, and the
        two groups stay out of phase round after round. A fresh run (its next round is
        fragment 0's) starts at phase 0, the plain schedule."""
        first = min(range(self._fragments), key=lambda f: rounds[f] + self._fragments)
        every = self.algorithm.sync_every
        return (self.algorithm.offset(first) - self.algorithm.offset(0)) % every

    def _sync_point(self, fragment: int) -> None:
        """``fragment`` is due at this step: contribute it (waiting first if its previous
        contribution is still in flight, unless free-running)."""
        # A commit staged since this step() began: applied first, so the contribution is
        # built on it (else it would go to a round that is already committed).
        self._apply_staged()
        with self._lock:
            self._counters.sync_points += 1
            busy = fragment in self._inflight
            if busy and self.free_running:
                self._counters.skipped_syncs += 1
        if busy:
            if self.free_running:
                self._emit(SyncSkipped(self.learner_id, fragment=fragment, step=self._steps))
                return
            # Never drop a sync point: wait for the previous round of this fragment.
            if not self._await(fragment, time.monotonic() + self.wait_timeout):
                # Gave up (reported as SyncWaited(timed_out=True)): this sync point passes
                # uncontributed, its steps go into the next one.
                with self._lock:
                    self._counters.skipped_syncs += 1
                return
        self._hand_over(fragment)
        if self.overlap == 0 and not self.free_running:
            self._await(fragment, time.monotonic() + self.wait_timeout)

    def _hand_over(self, fragment: int) -> None:
        pending = _Pending(
            round=self._applied[fragment] + self._fragments,
            fragment=fragment,
            base=self._applied[fragment],
            snapshot=self._layout.copy_out(fragment, self._snapshots),
            base_params=self._ref[fragment],
            samples=self._samples - self._counted[fragment],
            step=self._steps,
        )
        inner = self._steps - self._contributed_at[fragment]
        self._counted[fragment] = self._samples
        self._contributed_at[fragment] = self._steps
        with self._lock:
            self._inflight[fragment] = pending
            self._outbox.append(pending)
            self._counters.last_inner_steps = inner
        if self.overlap > 0 and not self.free_running:
            self._wait_at = min(self._wait_at, self._steps + self.overlap)
        self._wake_comm.set()

    def _wait_due(self) -> None:
        """``overlap`` steps have passed since a contribution: wait for its commit."""
        with self._lock:
            due = [
                pending.fragment
                for pending in self._inflight.values()
                if pending.step + self.overlap <= self._steps and not pending.gave_up
            ]
        for fragment in due:
            self._await(fragment, time.monotonic() + self.wait_timeout)
        self._reschedule()

    def _reschedule(self) -> None:
        if self.overlap == 0 or self.free_running:
            self._wait_at = _NEVER
            return
        with self._lock:
            steps = [
                pending.step + self.overlap
                for pending in self._inflight.values()
                if not pending.gave_up
            ]
        self._wait_at = min(steps, default=_NEVER)

    def _await(self, fragment: int, deadline: float) -> bool:
        """Hold the training thread until ``fragment`` has nothing in flight (its commit
        applied, or its publish failed), or until ``deadline``; False when it gave up."""
        with self._lock:
            pending = self._inflight.get(fragment)
        if pending is None:
            return True
        started = time.monotonic()
        with self._lock:
            self._waiting_since = started  # beats count a wait in progress too
        done = False
        while True:
            # Lowered before looking: a commit staged after the look raises it again, so
            # the wait below returns at once instead of missing it.
            self._changed.clear()
            self._apply_staged()
            with self._lock:
                done = self._inflight.get(fragment) is not pending
            left = deadline - time.monotonic()
            if done or left <= 0:
                break
            self._changed.wait(min(left, 0.5))
        seconds = time.monotonic() - started
        with self._lock:
            self._waiting_since = None
            self._counters.waits += 1
            self._counters.waited_s += seconds
            if not done:
                self._counters.wait_timeouts += 1
                pending.gave_up = True
        self._emit(
            SyncWaited(
                self.learner_id,
                fragment=fragment,
                round=pending.round,
                step=self._steps,
                seconds=seconds,
                timed_out=not done,
            )
        )
        return done

    def _contribute_all(self, deadline: float) -> list[int]:
        """Contribute every fragment with steps not yet contributed and wait for all of this
        learner's rounds in flight; the rounds still waited for at ``deadline``."""
        # A contribution can miss its round: the round closed without it (round_timeout)
        # before it was published, and its steps went back to the fragment. Then it goes
        # again, to the next round, until every step is in a commit or the deadline passes
        # (a few passes at most: each one waits for a round).
        for _ in range(_CONTRIBUTE_PASSES):
            handed = False
            for fragment in range(self._fragments):
                if self._samples == self._counted[fragment]:
                    continue  # nothing new since its last contribution
                if not self._await(fragment, deadline):
                    continue
                if self._samples == self._counted[fragment]:
                    continue
                # Each hand-over is a sync point: one that missed its round was published
                # (counted so) and its steps go again, as a contribution of their own; so
                # published + skipped = sync points holds however many passes it takes.
                with self._lock:
                    self._counters.sync_points += 1
                # All fragments at once, not one after another: a learner with nothing new
                # for fragment 0 would hand fragment 1 over while the others still wait
                # in fragment 0's round for it, and the two rounds could close without
                # each other's contributions (round_timeout). The price: a copy of every
                # fragment in flight here (the whole model), once, at the end.
                self._hand_over(fragment)
                handed = True
            for fragment in range(self._fragments):
                self._await(fragment, deadline)
            if not handed or time.monotonic() >= deadline:
                break
        self._reschedule()
        with self._lock:
            return sorted(pending.round for pending in self._inflight.values())

    def _apply_staged(self) -> None:
        if not self._staged:  # the hot path of step(): a commit staged just now waits a step
            return
        with self._lock:
            staged, self._staged = self._staged, {}
        for item in staged.values():
            self._apply(item)
        self._reschedule()

    def _apply(self, item: _Staged) -> None:
        commit = item.commit
        fragment = commit.fragment
        if commit.round <= self._applied[fragment]:
            return
        with self._lock:
            pending = self._inflight.get(fragment)
        contributed = (
            pending is not None
            and pending.payload is not None
            and (pending.round, pending.payload) in item.mine
        )
        if contributed and pending is not None and pending.step == self._steps:
            # No local step since the snapshot: the commit is the whole truth. Loaded, not
            # rebased, so the result is bitwise the commit (a + g − a is not always g).
            self._layout.load(fragment, item.params)
        elif contributed and pending is not None and self.mixing is not None:
            # Streaming DiLoCo's blend of the late commit with the local progress since.
            self._layout.mix(fragment, item.params, self.mixing)
        else:
            # Keep the local progress the commit does not already hold: since the snapshot
            # if it was combined, else since the previous commit.
            anchor = pending.snapshot if contributed and pending else self._ref[fragment]
            self._layout.rebase(fragment, item.params, anchor)
        if contributed and pending is not None and pending.residual is not None:
            # Its contribution is in this commit: what it did not send is kept for the next.
            self._residual[fragment] = pending.residual
        self._ref[fragment] = item.params
        self._applied[fragment] = commit.round
        lag = 0.0
        if pending is not None and pending.round <= commit.round:
            with self._lock:
                del self._inflight[fragment]
                pending.cancelled = True
                # Let go of its buffers now, whoever still holds the record (the
                # communication thread may be sweeping with it in hand): the pools reuse
                # them at the next sync point instead of making new ones. Anyone using
                # them right now holds its own reference.
                pending.snapshot = {}
                pending.base_params = {}
                pending.compressed = pending.residual = None
                published = pending.payload is not None
                self._counters.applied += 1
                if contributed:
                    # From the sync point: hashing and uploading the snapshot are part of
                    # what training waits for (or overlaps).
                    lag = time.monotonic() - pending.handed_at
                    self._counters.last_commit_lag_s = lag
            if not contributed:
                self._counted[fragment] -= pending.samples  # it goes into the next one
                if not published:
                    # Never published: the round closed without it. Its sync point passed
                    # uncontributed (so published + skipped = sync points).
                    with self._lock:
                        self._counters.skipped_syncs += 1
        self._emit(
            Applied(
                self.learner_id,
                round=commit.round,
                fragment=fragment,
                contributed=contributed,
                lag_s=lag,
            )
        )
