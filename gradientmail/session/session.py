"""Session: one learner's membership in a run.

The constructor joins on the calling thread: it creates the run or checks that this node
matches it, then loads the newest commit of every fragment into the model. Two background
threads follow, each with its own event loop and one shared mailbox:

- the *communication* thread publishes contributions, renews the lease (a task of its own,
  so a long transfer never starves it), and closes rounds this learner contributed to
  (``engine/closer.py``); a round it closes is staged for the training thread at once;
- the *syncer* polls ``rounds/`` for new commits, verifies them and stages them, record by
  record and fragment by fragment, so one bad record or one failed download holds back
  nothing else.

The training thread calls :meth:`Session.step`: it applies staged commits to the model (so
parameters never change under a running optimizer step; no lock is needed) and, when a
fragment is due, copies it and hands the copy over. Every sync point contributes. How late
its commit may be applied is ``overlap`` (inner steps): with ``overlap=0`` ``step()`` waits
at the sync point until the round is committed and applied (exact DiLoCo); with
``overlap=τ`` training runs on and ``step()`` waits only if the commit has not been applied
``τ`` steps later (or at the fragment's next sync point, whichever comes first). Waits are
bounded, counted and reported (``SyncWaited``). ``free_running=True`` keeps the old
behaviour for who wants it: a sync point whose fragment is still in flight is skipped
(``SyncSkipped``), never waited for.

With ``algorithm=gm.Moshpit(...)`` the same loop averages in small groups instead of
run-wide rounds (``session/_groups.py``, ``engine/groups.py``): the communication thread
publishes to this learner's group of the next group round, closes the group or waits for
its closer, and stages the group's average; there is no syncer thread (a group commit is
this learner's own business, nobody else's commits are applied).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.contribution import compression_of
from gradientmail.algorithms.moshpit import Moshpit
from gradientmail.coord.heartbeat import Heartbeat
from gradientmail.coord.leases import LeaseTracker, beating
from gradientmail.coord.threads import Wake, run_coroutine
from gradientmail.engine.closer import RoundCloser
from gradientmail.engine.groups import GroupRounds, download_average, newest_group_round
from gradientmail.engine.join import establish, load_newest
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ProtocolError
from gradientmail.events import (
    Counters,
    Event,
    Joined,
    Left,
    PollFailed,
)
from gradientmail.ledger import GLOBAL, SNAPSHOTS
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.metered import Metered
from gradientmail.payload._malloc import share_arenas
from gradientmail.payload.buffers import BufferPool
from gradientmail.session._groups import _GroupSide
from gradientmail.session._resume import _Resuming
from gradientmail.session._state import _default_learner_id, _Pending, _Staged
from gradientmail.session._training import _NEVER, _TrainingSide

__all__ = ["Session"]

_log = logging.getLogger("gradientmail")


class Session(_TrainingSide, _GroupSide, _Resuming):
    """Join a run as ``learner_id`` and train ``model`` in it.

    ``overlap``: how many local steps a contribution's commit may be applied late (0: exact
    DiLoCo, ``step()`` waits at every sync point for its round). A commit applied late
    keeps the local progress made since the snapshot (``param ← commit + (param −
    snapshot)``) or, with ``mixing=α``, blends as Streaming DiLoCo does (``param ← α·param
    + (1 − α)·commit``). ``free_running=True`` never waits: a sync point whose fragment is
    still in flight is skipped (``SyncSkipped``), so fewer, longer inner phases per commit.

    ``algorithm``: ``gm.DiLoCo`` (one closer per round combines every learner's
    contribution), ``gm.SparseLoCo`` or ``gm.Moshpit`` (small groups on a grid, each closed
    by one of its members: no closer downloads more than its group). For Moshpit,
    ``round_timeout`` is how long a group waits for members it expects that have not come
    (the others close it with who came) and ``quorum_size`` is not used.

    ``quorum_size`` contributions let a round close once ``round_timeout`` seconds passed
    without every live learner contributing. ``lease_timeout`` is how long a learner stays
    live without a new beat. A closer's claim on a round is honoured for ``claim_timeout``
    seconds (default ``round_timeout + lease_timeout``) even while its holder is live: a
    closer that keeps failing is replaced. A wait for a commit gives up after
    ``wait_timeout`` seconds (default: ``round_timeout`` plus three lease periods, time for a
    closer to fail over).
    ``on_event`` is called on background threads.

    ``optimizer``: the training's optimizer, to resume it when this learner restarts: its
    state and this learner's counters are stored in the mailbox every ``optimizer_every``
    of its sync points (default: 10 per fragment) and at ``close()``, and a Session with the
    same ``learner_id`` loads the newest before its first step (``session/_resume.py``).

    A learner id is one process at a time: when another process is beating as
    ``learner_id`` (its newest beat advances while this one watches), the constructor raises
    ``ProtocolError`` naming the id and its last beat's age. The same id restarted after a
    crash resumes its place: its earlier life's beats no longer advance. Telling the two
    apart costs a restart whose earlier life did not leave (crashed, killed) a wait of up
    to 1.5 beat intervals (``lease_timeout / 2``: 7.5 s by default); a first start, or one
    after a clean leave, does not wait.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        algorithm: Algorithm,
        mailbox: Mailbox,
        learner_id: str | None = None,
        overlap: int = 0,
        mixing: float | None = None,
        free_running: bool = False,
        quorum_size: int = 1,
        round_timeout: float = 10.0,
        poll_interval: float = 0.5,
        idle_poll_interval: float = 5.0,
        lease_timeout: float = 15.0,
        join_timeout: float = 120.0,
        close_timeout: float = 120.0,
        wait_timeout: float | None = None,
        claim_timeout: float | None = None,
        keep_rounds: int = 2,
        on_event: Callable[[Event], None] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_every: int | None = None,
    ) -> None:
        # Everything is validated before anything is written.
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                "algorithm must be a gm.Algorithm such as gm.DiLoCo, not "
                f"{type(algorithm).__name__}"
            )
        if not isinstance(mailbox, Mailbox):
            raise TypeError(f"mailbox must implement gm.Mailbox, not {type(mailbox).__name__}")
        self.learner_id = (
            _default_learner_id() if learner_id is None else p.check_learner_id(learner_id)
        )
        if not isinstance(quorum_size, int) or quorum_size < 1:
            raise ValueError(f"quorum_size must be an int >= 1, not {quorum_size!r}")
        if type(overlap) is not int or overlap < 0:
            raise ValueError(f"overlap must be an int >= 0 (inner steps), not {overlap!r}")
        if mixing is not None and (
            not isinstance(mixing, int | float) or isinstance(mixing, bool) or not 0 <= mixing < 1
        ):
            raise ValueError(f"mixing must be None or a number in [0, 1), not {mixing!r}")
        if not isinstance(free_running, bool):
            raise ValueError(f"free_running must be a bool, not {free_running!r}")
        if claim_timeout is None:
            claim_timeout = round_timeout + lease_timeout
        if wait_timeout is None:
            wait_timeout = round_timeout + 3 * lease_timeout
        for name, value in (
            ("round_timeout", round_timeout),
            ("poll_interval", poll_interval),
            ("idle_poll_interval", idle_poll_interval),
            ("lease_timeout", lease_timeout),
            ("join_timeout", join_timeout),
            ("close_timeout", close_timeout),
            ("wait_timeout", wait_timeout),
            ("claim_timeout", claim_timeout),
        ):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
        if not isinstance(keep_rounds, int) or keep_rounds < 1:
            raise ValueError(f"keep_rounds must be an int >= 1, not {keep_rounds!r}")

        share_arenas()  # before this Session's threads start (payload/_malloc.py)
        self.algorithm = algorithm
        self.model = model
        self._layout = ModelLayout(model, algorithm)
        self._fragments = self._layout.count
        self._setup_resume(optimizer, optimizer_every, model)
        self.overlap = overlap
        self.mixing = None if mixing is None else float(mixing)
        self.free_running = free_running
        self.poll_interval = float(poll_interval)
        self.idle_poll_interval = max(float(idle_poll_interval), self.poll_interval)
        self.close_timeout = float(close_timeout)
        self.wait_timeout = float(wait_timeout)
        self._on_event = on_event
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._counters = Counters()
        self.events: deque[Event] = deque(maxlen=1000)
        self._box = Metered(mailbox, self._counters, self._lock)
        # The closer's events wait until its commit is staged: a slow on_event must not
        # delay the hand-over of the new parameters (the syncer would download them).
        self._closer_events: list[Event] = []
        # Fragment copies handed to the communication thread, and commit parameters (a
        # closer's sums, the syncer's downloads: both become the reference): each pool
        # keeps one released buffer for reuse, whatever the number of fragments.
        self._snapshots = BufferPool(SNAPSHOTS)
        self._globals = BufferPool(GLOBAL)
        self._tracker = LeaseTracker(lease_timeout)
        self._closer = RoundCloser(
            self._box,
            self._layout,
            algorithm,
            self.learner_id,
            self._tracker,
            quorum_size=quorum_size,
            round_timeout=round_timeout,
            keep_rounds=keep_rounds,
            claim_timeout=float(claim_timeout),
            emit=self._closer_events.append,
            global_pool=self._globals,
        )

        # A Moshpit run averages in small groups (engine/groups.py), not in run-wide rounds.
        self._groups = (
            GroupRounds(
                self._box,
                self._layout,
                algorithm,
                self.learner_id,
                self._tracker,
                round_timeout=round_timeout,
                claim_timeout=float(claim_timeout),
                keep_rounds=keep_rounds,
            )
            if isinstance(algorithm, Moshpit)
            else None
        )

        # Training-thread state (the lock guards what the background threads also touch).
        self._steps = 0
        self._start_step = 0  # the step count this life starts from (a resume's, or 0)
        self._samples = 0
        # Samples counted when each fragment last contributed (the next one carries the rest).
        self._counted = [0] * self._fragments
        self._contributed_at = [0] * self._fragments  # local step of each one's last
        # Local step (mod sync_every) -> the fragment due then: one lookup per step().
        self._due = {self.algorithm.offset(f): f for f in range(self._fragments)}
        # The local step at which step() must next wait for an in-flight commit (overlap).
        self._wait_at = _NEVER
        self._phase = 0  # added to the step count for the schedule (see _schedule_phase)
        self._waiting_since: float | None = None  # when a wait in progress began
        self._applied = [0] * self._fragments
        self._ref: list[dict[str, torch.Tensor]] = [{} for _ in range(self._fragments)]
        self._inflight: dict[int, _Pending] = {}
        self._outbox: deque[_Pending] = deque()
        # At most one staged commit per fragment: a newer one replaces (merges) the older,
        # so memory stays bounded however long step() is not called.
        self._staged: dict[int, _Staged] = {}
        # A compressing algorithm's error feedback, per fragment (algorithms/contribution.py):
        # replaced when a commit holding this learner's contribution is applied.
        self._compression = compression_of(algorithm)
        self._residual: list[dict[str, torch.Tensor] | None] = [None] * self._fragments
        # Stateless compressed rounds (SparseLoCo) are computed from their contributions
        # by a learner that has the previous commit: it downloads no dense parameters.
        self._delta_downloads = self._compression is not None and not any(
            algorithm.state_specs(specs) for specs in self._layout.specs
        )
        self._last_commit: list[tuple[int, dict[str, torch.Tensor]]] = [
            (0, {}) for _ in range(self._fragments)
        ]
        self._known = [0] * self._fragments  # newest commit per fragment seen or staged
        self._bad: set[str] = set()  # round records reported unreadable (reported once)
        self._heartbeat = Heartbeat(
            self._box, p.LEASES, self.learner_id, self._beat_record, lease_timeout / 3
        )
        self._wake_sync = Wake()  # this learner published or committed: look for commits
        self._wake_comm = Wake()  # step() handed a fragment over
        self._wake_beat = Wake()  # a contribution was published: beat its counters now
        self._closed = False

        self.creator = run_coroutine(self._join(float(join_timeout)))
        self._threads = [
            threading.Thread(
                target=self._thread_main,
                args=(self._communicate,),
                name=f"gm-comm-{self.learner_id}",
                daemon=True,
            ),
        ]
        if self._groups is None:  # a Moshpit learner's group commits come to its comm thread
            self._threads.append(
                threading.Thread(
                    target=self._thread_main,
                    args=(self._sync,),
                    name=f"gm-sync-{self.learner_id}",
                    daemon=True,
                )
            )
        for thread in self._threads:
            thread.start()

    # -- public ------------------------------------------------------------------------------

    def step(self, samples: int = 1) -> None:
        """Count one local training step over ``samples`` samples; sync when due.

        Call it after the optimizer step. It applies commits that arrived (in place, on this
        thread) and, when a fragment is due, copies it for the communication thread. It
        waits for a commit only where ``overlap`` says so (see the class docstring).
        """
        # The hot path (most calls): a type check, a flag, two counters, a comparison and
        # one dict lookup.
        if type(samples) is not int or samples < 1:
            raise ValueError(f"step(samples={samples!r}): samples must be an int >= 1")
        if self._closed:
            raise RuntimeError("step() on a closed Session")
        if self._staged:
            self._apply_staged()
        if self._steps == self._start_step:
            # The first step: commits that landed since the join are applied now; start
            # the schedule from them (see _schedule_phase), whatever count a resume
            # continues from.
            phase = self._schedule_phase(dict(enumerate(self._applied)))
            self._phase = (phase - self._start_step) % self.algorithm.sync_every
        self._steps += 1
        self._samples += samples
        if self._steps >= self._wait_at:
            self._wait_due()
        fragment = self._due.get((self._steps + self._phase) % self.algorithm.sync_every)
        if fragment is None:
            return
        self._sync_point(fragment)
        if self._optimizer is not None:
            self._resume_point()

    def sync(self, timeout: float | None = None) -> tuple[int, ...]:
        """Contribute every fragment's steps since its last contribution now, and wait
        until those commits are applied; for evaluation and checkpoints. Every fragment
        goes at once, so this holds a copy of the whole model while it waits.

        Returns :attr:`rounds`. Raises ``TimeoutError`` when a commit is not applied within
        ``timeout`` seconds (default ``wait_timeout``); the contributions stay in flight.
        """
        if self._closed:
            raise RuntimeError("sync() on a closed Session")
        limit = self.wait_timeout if timeout is None else float(timeout)
        waiting = self._contribute_all(time.monotonic() + limit)
        if waiting:
            raise TimeoutError(
                f"Session.sync(): rounds {waiting} of learner {self.learner_id} were not "
                f"applied within {limit:.0f} s"
            )
        return self.rounds

    def close(self, timeout: float | None = None) -> None:
        """Contribute the steps since each fragment's last sync point, wait for this
        learner's rounds in flight to commit, then leave the run."""
        if self._closed:
            return
        limit = self.close_timeout if timeout is None else timeout
        try:
            waiting = self._contribute_all(time.monotonic() + limit)
        finally:
            self._closed = True
            self._stop.set()
            for thread in self._threads:
                thread.join(timeout=60)
        self._save_at_close()
        self._leave()
        self._emit(Left(self.learner_id, clean=not waiting))
        if waiting:
            raise TimeoutError(
                f"Session.close(): rounds {waiting} of learner {self.learner_id} did not "
                f"commit within {limit:.0f} s; their contributions may be lost"
            )

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            # Training failed: leave without contributing (or waiting for) its last steps.
            self._abandon()
            return
        self.close()

    def counters(self) -> Counters:
        """A copy of the traffic and progress counters."""
        with self._lock:
            c = self._counters
            return replace(
                c,
                requests=dict(c.requests),
                bytes_up=dict(c.bytes_up),
                bytes_down=dict(c.bytes_down),
            )

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def rounds(self) -> tuple[int, ...]:
        """The round of the commit currently applied, per fragment."""
        return tuple(self._applied)

    # -- the training-thread side ------------------------------------------------------------

    def _abandon(self) -> None:
        """Leave at once (training raised): stop the threads and write the leaving beat."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        self._leave()
        self._emit(Left(self.learner_id, clean=False))

    # -- joining -----------------------------------------------------------------------------

    async def _join(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        await self._check_not_live(deadline)
        _, creator = await establish(
            self._box,
            self._layout,
            self.algorithm,
            self.learner_id,
            timeout,
            lease_timeout=self._tracker.lease_timeout,
        )
        # A restarted learner's optimizer state and counters (Session(optimizer=...)): before
        # its first beat, which carries the counts; a mismatched optimizer raises before
        # this learner ever looks live.
        await self._restore(deadline)
        # Live first, then load: from its first beat the others wait for this learner in
        # their rounds, so few commits can land between the load below and its first
        # contribution (which goes to the round the others are in: the schedule's phase
        # is taken at the first step, from the commits applied by then).
        # A restarted learner continues its own beat numbers (its leaving beat of a
        # previous life removed first, or it would read as gone for good).
        await self._heartbeat.start(deadline=deadline)
        rounds, tensors = await load_newest(
            self._box, self._layout, deadline, algorithm=self.algorithm
        )
        if self._groups is not None:
            await self._join_groups(tensors, rounds)
        for fragment, values in tensors.items():
            self._layout.load(fragment, values)
            self._ref[fragment] = values
            self._applied[fragment] = self._known[fragment] = rounds[fragment]
            if self._delta_downloads:
                self._last_commit[fragment] = (rounds[fragment], values)
        self._emit(Joined(self.learner_id, creator=creator, rounds=tuple(self._applied)))
        return creator

    async def _join_groups(
        self, tensors: dict[int, dict[str, torch.Tensor]], rounds: dict[int, int]
    ) -> None:
        """A Moshpit learner's slot, and the model it starts from: the average of the
        newest group round's commits when the run has any (a late joiner), else the initial
        commit. Its group rounds continue from that round."""
        groups = self._groups
        assert groups is not None
        assert isinstance(self.algorithm, Moshpit)
        await groups.join()
        commits = await newest_group_round(self._box)
        if not commits:
            return
        tensors[0] = await download_average(self._box, self.algorithm, self._layout, commits)
        rounds[0] = groups.last_round = commits[0].round

    async def _check_not_live(self, deadline: float) -> None:
        """Refuse a learner id that another process is beating as right now; an earlier life
        of this learner (crashed, killed: beats that stopped) is resumed. Before the
        heartbeat starts, which would delete the other's beats."""
        found = await beating(
            self._box, [self.learner_id], self._heartbeat.interval, deadline=deadline
        )
        if self.learner_id in found:
            live = found[self.learner_id]
            raise ProtocolError(
                f"learner {self.learner_id} is already live in this run: its beat advanced "
                f"to {live.beat} {live.age:.1f} s ago, so another process holds this learner "
                "id; give this node another learner_id, or stop the other one first"
            )

    # -- background threads ------------------------------------------------------------------

    def _beat_record(self, leaving: bool) -> bytes:
        """A beat carries this learner's counters (``gradientmail status`` shows them)."""
        with self._lock:
            c = self._counters
            waited = c.waited_s
            if self._waiting_since is not None:  # a wait in progress counts too
                waited += time.monotonic() - self._waiting_since
            beat = p.Beat(
                self.learner_id,
                self._steps,
                self._samples,
                leaving,
                sync_points=c.sync_points,
                contributed=c.published,
                waited_s=round(waited, 3),
                skipped=c.skipped_syncs,
                bytes_up=sum(c.bytes_up.values()),
                bytes_down=sum(c.bytes_down.values()),
            )
        return p.encode(beat)

    def _leave(self) -> None:
        try:
            run_coroutine(self._heartbeat.leave(deadline=time.monotonic() + 30))
        except Exception as exc:  # the lease will lapse on its own
            self._emit(PollFailed(self.learner_id, error=f"leaving beat: {exc!r}"))
