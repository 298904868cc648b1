"""Session: one learner's membership in a run.

The constructor joins on the calling thread: it creates the run or checks that this node
matches it, then loads the newest commit of every fragment into the model. Two background
threads follow, each with its own event loop and one shared mailbox:

- the *communication* thread publishes contributions, renews the lease (a task of its own,
  so a long transfer never starves it), and closes rounds this learner contributed to; a
  round it closes is staged for the training thread at once;
- the *syncer* polls ``rounds/`` for new commits, verifies them and stages them, record by
  record and fragment by fragment, so one bad record or one failed download holds back
  nothing else.

How a round is exchanged is ONE :class:`~gradientmail.engine.exchange.Exchange`, chosen
once from the algorithm (``engine/exchanges.py``): the Session composes it with a
:class:`~gradientmail.session._training.TrainingLoop` (the training thread), a
:class:`~gradientmail.session._comm.Communication` (the background threads), a
:class:`~gradientmail.session._resume.Resume` and the state they share
(:class:`~gradientmail.session._state.Shared`).

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
run-wide rounds (``engine/exchange_groups.py``, ``engine/groups.py``): the communication thread
publishes to this learner's group of the next group round, closes the group or waits for
its closer, and stages the group's average; there is no syncer thread (a group commit is
this learner's own business, nobody else's commits are applied).

A learner of many ranks (``torch.distributed`` initialized, or ``group=``): every rank
constructs the Session and calls it the same way; rank 0 alone does all of the above, and
after each call the others receive what it applied (``session/_ranks.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.algorithms.contribution import compression_of
from gradientmail.coord.heartbeat import Heartbeat
from gradientmail.coord.leases import LeaseTracker, beating
from gradientmail.coord.threads import run_coroutine
from gradientmail.engine.align import load_newest
from gradientmail.engine.exchange import ExchangeContext
from gradientmail.engine.exchanges import exchange_for
from gradientmail.engine.join import establish
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ProtocolError, RanksFailed
from gradientmail.events import Counters, Event, Following, Joined, Left, PollFailed
from gradientmail.ledger import GLOBAL
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.metered import Metered
from gradientmail.payload._malloc import share_arenas
from gradientmail.payload.buffers import BufferPool
from gradientmail.session._comm import Communication
from gradientmail.session._ranks import RankGroup, learner_model
from gradientmail.session._resume import Resume
from gradientmail.session._state import Shared, _default_learner_id
from gradientmail.session._training import TrainingLoop

__all__ = ["Session"]

_log = logging.getLogger("gradientmail")


@dataclass(frozen=True)
class _Timeouts:
    """A Session's waits, in seconds, validated (``_timeouts``)."""

    round: float
    poll: float
    idle_poll: float
    lease: float
    join: float
    close: float
    wait: float
    claim: float


def _timeouts(
    round_timeout: float,
    poll_interval: float,
    idle_poll_interval: float,
    lease_timeout: float,
    join_timeout: float,
    close_timeout: float,
    wait_timeout: float | None,
    claim_timeout: float | None,
) -> _Timeouts:
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
    return _Timeouts(
        round=float(round_timeout),
        poll=float(poll_interval),
        idle_poll=max(float(idle_poll_interval), float(poll_interval)),
        lease=float(lease_timeout),
        join=float(join_timeout),
        close=float(close_timeout),
        wait=float(wait_timeout),
        claim=float(claim_timeout),
    )


def _check_settings(
    algorithm: Algorithm,
    mailbox: Mailbox,
    quorum_size: int,
    overlap: int,
    mixing: float | None,
    free_running: bool,
    keep_rounds: int,
) -> None:
    if not isinstance(algorithm, Algorithm):
        raise TypeError(
            f"algorithm must be a gm.Algorithm such as gm.DiLoCo, not {type(algorithm).__name__}"
        )
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"mailbox must implement gm.Mailbox, not {type(mailbox).__name__}")
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
    if not isinstance(keep_rounds, int) or keep_rounds < 1:
        raise ValueError(f"keep_rounds must be an int >= 1, not {keep_rounds!r}")


class Session:
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

    ``group``: with ``torch.distributed`` initialized, the ranks of the default process
    group (or of ``group``) are ONE learner: every rank constructs the Session alike and
    calls it alike; rank 0 alone talks to the mailbox and every rank holds its parameters
    bitwise after each call; ``samples`` is each rank's own (``session/_ranks.py``,
    docs/training.md "A learner of many ranks").
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
        group: dist.ProcessGroup | None = None,
    ) -> None:
        # Everything is validated before anything is written.
        _check_settings(algorithm, mailbox, quorum_size, overlap, mixing, free_running, keep_rounds)
        if learner_id is not None:
            p.check_learner_id(learner_id)
        self.learner_id = _default_learner_id() if learner_id is None else learner_id
        # A learner of many ranks: every rank goes through the same calls below (no I/O
        # until the join, which the leader alone makes).
        self._ranks = ranks = RankGroup.of(group)
        if ranks is not None and optimizer is not None:
            raise ValueError(
                "optimizer= (resume saves) is not supported yet for a learner of several "
                "ranks; leave it out (the learner then restarts from the run's newest commits)"
            )
        self.rank, self.ranks = (0, 1) if ranks is None else (ranks.rank, ranks.size)
        times = _timeouts(
            round_timeout,
            poll_interval,
            idle_poll_interval,
            lease_timeout,
            join_timeout,
            close_timeout,
            wait_timeout,
            claim_timeout,
        )
        # Launched by `gradientmail run` or the operator, the run's settings are the node
        # environment's, whatever the script built. Checked before anything is read or
        # written: a creator would otherwise write its own settings into the manifest, and
        # every node built from the run would then be refused. (launch/ builds Sessions,
        # so it sits above this package: imported here, when a Session is made.)
        from gradientmail.launch.env import launched_differences

        launched = launched_differences(self.learner_id, algorithm.settings())
        if launched:
            raise ProtocolError(
                "this node's algorithm is not the one it was launched with (build it with "
                "gm.NodeEnv.from_environ().build_algorithm(), or env.session(model)): "
                + "; ".join(launched)
            )

        share_arenas()  # before this Session's threads start (payload/_malloc.py)
        self.algorithm = algorithm
        self.model = model
        self.overlap = overlap
        self.mixing = None if mixing is None else float(mixing)
        self.free_running = free_running
        self.poll_interval = times.poll
        self.idle_poll_interval = times.idle_poll
        self.close_timeout = times.close
        self.wait_timeout = times.wait
        self._layout = ModelLayout(learner_model(model), algorithm)
        if ranks is not None:
            self.learner_id = ranks.agree(
                learner_id,
                _default_learner_id,
                self._layout,
                {**algorithm.settings(), "overlap": overlap, "mixing": mixing},
            )
        self._shared = shared = Shared(self.learner_id, self._layout.count, on_event)
        self.events: deque[Event] = shared.events
        self._training = TrainingLoop(
            shared,
            self._layout,
            algorithm,
            overlap=overlap,
            mixing=self.mixing,
            free_running=free_running,
            wait_timeout=self.wait_timeout,
        )
        self._box = Metered(mailbox, shared.counters, shared.lock)
        self._resume = Resume(
            shared,
            self._training,
            self._box,
            self._layout,
            optimizer,
            optimizer_every,
            model=model,
            compressing=compression_of(algorithm) is not None,
            close_timeout=self.close_timeout,
        )
        self.optimizer_every = self._resume.every
        self._tracker = LeaseTracker(times.lease)
        # Commit parameters (a closer's sums, the syncer's downloads: both become the
        # reference): the pool keeps one released buffer for reuse.
        self._exchange = exchange_for(
            ExchangeContext(
                host=shared,
                box=self._box,
                layout=self._layout,
                algorithm=algorithm,
                tracker=self._tracker,
                global_pool=BufferPool(GLOBAL),
                quorum_size=quorum_size,
                round_timeout=times.round,
                claim_timeout=times.claim,
                keep_rounds=keep_rounds,
            )
        )
        self._heartbeat = Heartbeat(
            self._box, p.LEASES, self.learner_id, self._beat_record, times.lease / 3
        )
        self._closed = False
        self._threads: list[threading.Thread] = []
        self.creator = False
        if ranks is not None:
            self._mirror(lambda: self._talk(times.join), "joining", joined=True)
            if not ranks.leader:
                shared.emit(Following(self.learner_id, ranks.rank, ranks.size, self.rounds))
            return
        self._talk(times.join)

    def _talk(self, join_timeout: float) -> None:
        """Join the run and start the background threads (a learner's leader rank only)."""
        self.creator = run_coroutine(self._join(join_timeout))
        self._threads = Communication(
            self._shared,
            self._exchange,
            self._box,
            self._tracker,
            self._heartbeat,
            self._resume,
            poll_interval=self.poll_interval,
            idle_poll_interval=self.idle_poll_interval,
        ).threads()
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
        if self._ranks is not None:
            ranks = self._ranks
            self._ranked(lambda: ranks.step(samples, self._training, self._layout))
        elif self._training.step(samples) and self._resume.optimizer is not None:
            self._resume.point()

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
        if self._ranks is not None:
            self._mirror(lambda: self._contribute_all(limit, "sync"), "sync()")
        else:
            self._contribute_all(limit, "sync")
        return self.rounds

    def close(self, timeout: float | None = None) -> None:
        """Contribute the steps since each fragment's last sync point, wait for this
        learner's rounds in flight to commit, then leave the run."""
        if self._closed:
            return
        limit = self.close_timeout if timeout is None else timeout
        if self._ranks is not None and not self._ranks.leader:
            # What the leader's close applied, and what it raised (a follower has no threads,
            # lease or resume save of its own).
            self._closed = True
            self._mirror(lambda: None, "close()")
            return
        late: TimeoutError | None = None
        try:
            if self._ranks is None:
                self._contribute_all(limit, "close")
            else:
                # Before the threads stop and the leaving beat: the followers receive the
                # last commits, or the close's TimeoutError.
                self._mirror(lambda: self._contribute_all(limit, "close"), "close()")
        except TimeoutError as exc:
            late = exc  # raised once this learner left
        finally:
            self._closed = True
            self._shared.stop.set()
            for thread in self._threads:
                thread.join(timeout=60)
        self._resume.at_close()
        self._leave()
        self._shared.emit(Left(self.learner_id, clean=late is None))
        if late is not None:
            raise late

    def _contribute_all(self, limit: float, call: str) -> None:
        """Contribute every fragment's steps not yet contributed and wait for the commits;
        ``TimeoutError`` after ``limit`` seconds (``call``: sync or close)."""
        waiting = self._training.contribute_all(time.monotonic() + limit)
        if not waiting:
            return
        if call == "sync":
            raise TimeoutError(
                f"Session.sync(): rounds {waiting} of learner {self.learner_id} were not "
                f"applied within {limit:.0f} s"
            )
        raise TimeoutError(
            f"Session.close(): rounds {waiting} of learner {self.learner_id} did not "
            f"commit within {limit:.0f} s; their contributions may be lost"
        )

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            # Training failed: leave without contributing (or waiting for) its last steps.
            self._abandon()
            return
        self.close()

    def counters(self) -> Counters:
        """A copy of the traffic and progress counters."""
        with self._shared.lock:
            c = self._shared.counters
            return replace(
                c,
                requests=dict(c.requests),
                bytes_up=dict(c.bytes_up),
                bytes_down=dict(c.bytes_down),
            )

    @property
    def steps(self) -> int:
        return self._training.steps

    @property
    def rounds(self) -> tuple[int, ...]:
        """The round of the commit currently applied, per fragment."""
        return tuple(self._training.applied)

    def _abandon(self) -> None:
        """Leave at once (training raised): stop the threads and write the leaving beat."""
        if self._closed:
            return
        self._closed = True
        if self._ranks is not None and not self._ranks.leader:
            return  # a follower: nothing in the mailbox to leave
        self._shared.stop.set()
        for thread in self._threads:
            thread.join(timeout=60)
        self._leave()
        self._shared.emit(Left(self.learner_id, clean=False))

    # -- a learner of many ranks -----------------------------------------------------------

    def _mirror(self, call: Callable[[], object], what: str, *, joined: bool = False) -> None:
        """``call`` on the leader rank, and its outcome on every rank (``_ranks.py``)."""
        ranks = self._ranks
        assert ranks is not None
        self._ranked(
            lambda: ranks.mirror(call, self._training, self._layout, what=what, joined=joined)
        )

    def _ranked(self, collective: Callable[[], object]) -> None:
        """Run ``collective``; when the ranks of this learner fail (one died), leave the run
        without contributing (the leader writes its leaving beat) and raise."""
        try:
            collective()
        except RanksFailed:
            self._abandon()
            raise

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
        await self._resume.restore(deadline)
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
        await self._exchange.joined(rounds, tensors)  # its place; a Moshpit joiner's model
        self._training.joined(rounds, tensors)
        self._shared.emit(Joined(self.learner_id, creator=creator, rounds=self.rounds))
        return creator

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
        shared, training = self._shared, self._training
        with shared.lock:
            c = shared.counters
            waited = c.waited_s
            if shared.waiting_since is not None:  # a wait in progress counts too
                waited += time.monotonic() - shared.waiting_since
            beat = p.Beat(
                self.learner_id,
                training.steps,
                training.samples,
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
            self._shared.emit(PollFailed(self.learner_id, error=f"leaving beat: {exc!r}"))
