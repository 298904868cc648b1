"""The training-thread side of a Session: the step count and sync schedule, sync points,
bounded waits for commits, contributions at close()/sync(), and applying staged commits.

Everything here runs on the thread that calls ``step()``, so the model's parameters change
only between optimizer steps; the shared state's lock guards what the background threads
also touch.
"""

from __future__ import annotations

import time

import torch

from gradientmail.algorithms.base import Algorithm
from gradientmail.engine.exchange import Pending
from gradientmail.engine.layout import ModelLayout
from gradientmail.events import Applied, SyncSkipped, SyncWaited
from gradientmail.ledger import SNAPSHOTS
from gradientmail.payload.buffers import BufferPool
from gradientmail.session._state import Shared, _Staged

_CONTRIBUTE_PASSES = 3  # close()/sync(): tries of a contribution that missed its round
_NEVER = 1 << 62  # a step number no run reaches: "no wait due"


class TrainingLoop:
    """One learner's training-thread state and rules (module docstring)."""

    def __init__(
        self,
        shared: Shared,
        layout: ModelLayout,
        algorithm: Algorithm,
        *,
        overlap: int,
        mixing: float | None,
        free_running: bool,
        wait_timeout: float,
    ) -> None:
        self.shared = shared
        self.layout = layout
        self.algorithm = algorithm
        self.overlap = overlap
        self.mixing = mixing
        self.free_running = free_running
        self.wait_timeout = wait_timeout
        self.fragments = n = layout.count
        # Fragment copies handed to the communication thread: the pool keeps one released
        # buffer for reuse, whatever the number of fragments.
        self.snapshots = BufferPool(SNAPSHOTS)
        self.steps = 0
        self.start_step = 0  # the step count this life starts from (a resume's, or 0)
        self.samples = 0
        # Samples counted when each fragment last contributed (the next one carries the rest).
        self.counted = [0] * n
        self.contributed_at = [0] * n  # local step of each one's last
        self.applied = [0] * n  # the round of the commit applied, per fragment
        # Local step (mod sync_every) -> the fragment due then: one lookup per step().
        self._due = {algorithm.offset(f): f for f in range(n)}
        # The local step at which step() must next wait for an in-flight commit (overlap).
        self._wait_at = _NEVER
        self._phase = 0  # added to the step count for the schedule (see _schedule_phase)

    def step(self, samples: int) -> bool:
        """One local step over ``samples`` samples (checked by the Session); True when it
        was a sync point."""
        if self.shared.staged:
            self._apply_staged()
        if self.steps == self.start_step:
            # The first step: commits that landed since the join are applied now; start
            # the schedule from them (see _schedule_phase), whatever count a resume
            # continues from.
            phase = self._schedule_phase(dict(enumerate(self.applied)))
            self._phase = (phase - self.start_step) % self.algorithm.sync_every
        self.steps += 1
        self.samples += samples
        if self.steps >= self._wait_at:
            self._wait_due()
        fragment = self._due.get((self.steps + self._phase) % self.algorithm.sync_every)
        if fragment is None:
            return False
        self._sync_point(fragment)
        return True

    def joined(self, rounds: dict[int, int], tensors: dict[int, dict[str, torch.Tensor]]) -> None:
        """The join's commits (``{fragment: round}``, parameters) into the model."""
        shared = self.shared
        for fragment, values in tensors.items():
            self.layout.load(fragment, values)
            shared.ref[fragment] = values
            self.applied[fragment] = shared.known[fragment] = rounds[fragment]

    def resumed(self, step: int, samples: int) -> None:
        """The counts continue from a resume save's; the sync schedule starts from the
        join's commits all the same (``start_step``: see :meth:`step`)."""
        self.steps = self.start_step = step
        self.samples = samples
        # Every sample so far counts as contributed: the next contribution of each
        # fragment carries this life's samples only.
        self.counted = [samples] * self.fragments
        self.contributed_at = [step] * self.fragments

    def _schedule_phase(self, rounds: dict[int, int]) -> int:
        """Where this learner's sync schedule starts, so that its first contribution goes
        to the round the others are in: the fragment whose next round comes first.

        A learner that joins (or rejoins) a run in progress counts its steps from 0. Had it
        started with fragment 0 whatever the run was doing, it could wait in fragment 0's
        round for the others while they waited in fragment 1's round for it: with every
        live learner awaited, both rounds then close only at ``round_timeout``, and the
        two groups stay out of phase round after round. A fresh run (its next round is
        fragment 0's) starts at phase 0, the plain schedule."""
        first = min(range(self.fragments), key=lambda f: rounds[f] + self.fragments)
        every = self.algorithm.sync_every
        return (self.algorithm.offset(first) - self.algorithm.offset(0)) % every

    def _sync_point(self, fragment: int) -> None:
        """``fragment`` is due at this step: contribute it (waiting first if its previous
        contribution is still in flight, unless free-running)."""
        # A commit staged since this step() began: applied first, so the contribution is
        # built on it (else it would go to a round that is already committed).
        self._apply_staged()
        with self.shared.lock:
            self.shared.counters.sync_points += 1
            busy = fragment in self.shared.inflight
            failure = self.shared.inflight[fragment].failure if busy else None
            if busy and self.free_running and failure is None:
                self.shared.counters.skipped_syncs += 1
        if failure is not None:
            raise failure  # nobody can make its previous round (engine/failures.py)
        if busy:
            if self.free_running:
                self.shared.emit(
                    SyncSkipped(self.shared.learner_id, fragment=fragment, step=self.steps)
                )
                return
            # Never drop a sync point: wait for the previous round of this fragment.
            if not self._await(fragment, time.monotonic() + self.wait_timeout):
                # Gave up (reported as SyncWaited(timed_out=True)): this sync point passes
                # uncontributed, its steps go into the next one.
                with self.shared.lock:
                    self.shared.counters.skipped_syncs += 1
                return
        self._hand_over(fragment)
        if self.overlap == 0 and not self.free_running:
            self._await(fragment, time.monotonic() + self.wait_timeout)

    def _hand_over(self, fragment: int) -> None:
        pending = Pending(
            round=self.applied[fragment] + self.fragments,
            fragment=fragment,
            base=self.applied[fragment],
            snapshot=self.layout.copy_out(fragment, self.snapshots),
            base_params=self.shared.ref[fragment],
            samples=self.samples - self.counted[fragment],
            step=self.steps,
        )
        inner = self.steps - self.contributed_at[fragment]
        self.counted[fragment] = self.samples
        self.contributed_at[fragment] = self.steps
        with self.shared.lock:
            self.shared.inflight[fragment] = pending
            self.shared.outbox.append(pending)
            self.shared.counters.last_inner_steps = inner
        if self.overlap > 0 and not self.free_running:
            self._wait_at = min(self._wait_at, self.steps + self.overlap)
        self.shared.wake_comm.set()

    def _wait_due(self) -> None:
        """``overlap`` steps have passed since a contribution: wait for its commit."""
        with self.shared.lock:
            due = [
                pending.fragment
                for pending in self.shared.inflight.values()
                if pending.step + self.overlap <= self.steps and not pending.gave_up
            ]
        for fragment in due:
            self._await(fragment, time.monotonic() + self.wait_timeout)
        self._reschedule()

    def _reschedule(self) -> None:
        if self.overlap == 0 or self.free_running:
            self._wait_at = _NEVER
            return
        with self.shared.lock:
            steps = [
                pending.step + self.overlap
                for pending in self.shared.inflight.values()
                if not pending.gave_up
            ]
        self._wait_at = min(steps, default=_NEVER)

    def _await(self, fragment: int, deadline: float) -> bool:
        """Hold the training thread until ``fragment`` has nothing in flight (its commit
        applied, or its publish failed), or until ``deadline``; False when it gave up.
        Raises the in-flight round's failure when nobody can make it (``RoundImpossible``,
        found by the communication thread: ``engine/failures.py``)."""
        with self.shared.lock:
            pending = self.shared.inflight.get(fragment)
        if pending is None:
            return True
        started = time.monotonic()
        with self.shared.lock:
            self.shared.waiting_since = started  # beats count a wait in progress too
        done = False
        while True:
            # Lowered before looking: a commit staged after the look raises it again, so
            # the wait below returns at once instead of missing it.
            self.shared.changed.clear()
            self._apply_staged()
            with self.shared.lock:
                done = self.shared.inflight.get(fragment) is not pending
                failure = pending.failure
            left = deadline - time.monotonic()
            if done or failure is not None or left <= 0:
                break
            self.shared.changed.wait(min(left, 0.5))
        seconds = time.monotonic() - started
        if failure is not None and not done:
            with self.shared.lock:
                self.shared.waiting_since = None
            raise failure
        with self.shared.lock:
            self.shared.waiting_since = None
            self.shared.counters.waits += 1
            self.shared.counters.waited_s += seconds
            if not done:
                self.shared.counters.wait_timeouts += 1
                pending.gave_up = True
        self.shared.emit(
            SyncWaited(
                self.shared.learner_id,
                fragment=fragment,
                round=pending.round,
                step=self.steps,
                seconds=seconds,
                timed_out=not done,
            )
        )
        return done

    def contribute_all(self, deadline: float) -> list[int]:
        """Contribute every fragment with steps not yet contributed and wait for all of this
        learner's rounds in flight; the rounds still waited for at ``deadline``."""
        # A contribution can miss its round: the round closed without it (round_timeout)
        # before it was published, and its steps went back to the fragment. Then it goes
        # again, to the next round, until every step is in a commit or the deadline passes
        # (a few passes at most: each one waits for a round).
        for _ in range(_CONTRIBUTE_PASSES):
            handed = False
            for fragment in range(self.fragments):
                if self.samples == self.counted[fragment]:
                    continue  # nothing new since its last contribution
                if not self._await(fragment, deadline):
                    continue
                if self.samples == self.counted[fragment]:
                    continue
                # Each hand-over is a sync point: one that missed its round was published
                # (counted so) and its steps go again, as a contribution of their own; so
                # published + skipped = sync points holds however many passes it takes.
                with self.shared.lock:
                    self.shared.counters.sync_points += 1
                # All fragments at once, not one after another: a learner with nothing new
                # for fragment 0 would hand fragment 1 over while the others still wait
                # in fragment 0's round for it, and the two rounds could close without
                # each other's contributions (round_timeout). The price: a copy of every
                # fragment in flight here (the whole model), once, at the end.
                self._hand_over(fragment)
                handed = True
            for fragment in range(self.fragments):
                self._await(fragment, deadline)
            if not handed or time.monotonic() >= deadline:
                break
        self._reschedule()
        with self.shared.lock:
            return sorted(pending.round for pending in self.shared.inflight.values())

    def _apply_staged(self) -> None:
        if not self.shared.staged:  # the hot path of step(): a commit staged just now waits a step
            return
        with self.shared.lock:
            staged, self.shared.staged = self.shared.staged, {}
        for item in staged.values():
            self._apply(item)
        self._reschedule()

    def _apply(self, item: _Staged) -> None:
        commit = item.commit
        fragment = commit.fragment
        if commit.round <= self.applied[fragment]:
            return
        with self.shared.lock:
            pending = self.shared.inflight.get(fragment)
        contributed = (
            pending is not None
            and pending.payload is not None
            and (pending.round, pending.payload) in item.mine
        )
        if contributed and pending is not None and pending.step == self.steps:
            # No local step since the snapshot: the commit is the whole truth. Loaded, not
            # rebased, so the result is bitwise the commit (a + g − a is not always g).
            self.layout.load(fragment, item.params)
        elif contributed and pending is not None and self.mixing is not None:
            # Streaming DiLoCo's blend of the late commit with the local progress since.
            self.layout.mix(fragment, item.params, self.mixing)
        else:
            # Keep the local progress the commit does not already hold: since the snapshot
            # if it was combined, else since the previous commit.
            anchor = pending.snapshot if contributed and pending else self.shared.ref[fragment]
            self.layout.rebase(fragment, item.params, anchor)
        if contributed and pending is not None and pending.residual is not None:
            # Its contribution is in this commit: what it did not send is kept for the next.
            self.shared.residual[fragment] = pending.residual
        self.shared.ref[fragment] = item.params
        self.applied[fragment] = commit.round
        lag = 0.0
        if pending is not None and pending.round <= commit.round:
            with self.shared.lock:
                del self.shared.inflight[fragment]
                pending.cancelled = True
                # Let go of its buffers now, whoever still holds the record (the
                # communication thread may be sweeping with it in hand): the pools reuse
                # them at the next sync point instead of making new ones. Anyone using
                # them right now holds its own reference.
                pending.snapshot = {}
                pending.base_params = {}
                pending.compressed = pending.residual = None
                published = pending.payload is not None
                self.shared.counters.applied += 1
                if contributed:
                    # From the sync point: hashing and uploading the snapshot are part of
                    # what training waits for (or overlaps).
                    lag = time.monotonic() - pending.handed_at
                    self.shared.counters.last_commit_lag_s = lag
            if not contributed:
                self.counted[fragment] -= pending.samples  # it goes into the next one
                if not published:
                    # Never published: the round closed without it. Its sync point passed
                    # uncontributed (so published + skipped = sync points).
                    with self.shared.lock:
                        self.shared.counters.skipped_syncs += 1
        self.shared.emit(
            Applied(
                self.shared.learner_id,
                round=commit.round,
                fragment=fragment,
                contributed=contributed,
                lag_s=lag,
            )
        )
