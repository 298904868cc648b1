"""Shared Queue: every node walks the same list of work units; each unit is done once.

Every node iterates the same unit identifiers in the same order and claims each one with
the claim expression of spec 004, ``put_if_absent(f"units/{unit}", learner_id.encode())``
(:func:`claim`). A node loads only the units it won, on a background thread, and its
training loop takes their batches from a bounded buffer: the node's batches arrive in the
order it claimed the units, and within a unit in the order ``load`` produced them.

Keys (all created once with ``put_if_absent``; unit IDs are single key segments)
-------------------------------------------------------------------------------------

==========================================  ===================================================
``units/{unit}``                            first claim (attempt 0); holds the learner ID
``units-reclaims/{unit}/{attempt:04d}``     later claims (attempt 1, 2, …); hold the learner ID
``units-done/{unit}``                       done marker: ``{"learner": …, "attempt": …}``
``units-leases/{learner}/{beat:010d}``      the queue's lease: heartbeats, newest key wins
==========================================  ===================================================

The re-claims and done markers live beside ``units/``, not under ``units/{unit}/``: on a
filesystem store a key cannot also be the directory of another key.

Policy: exactly once across crashes
-----------------------------------

- **Owner.** A unit's owner is the learner named by its newest claim (the highest
  attempt). Only the owner loads it, and a node loads a unit only after winning a claim
  in its current life, so two nodes never both hold the newest claim.
- **Done.** A unit is done when the training loop has taken every batch of it and asked
  for the next one (a ``for`` loop finished its step on the unit's last batch). The queue
  then writes ``units-done/{unit}`` on its background thread. A unit that was claimed but
  not done when its node stopped (crash, ``break``, error) is *abandoned*.
- **Lease.** While a queue runs it renews a lease of its own, ``units-leases/{learner}/``,
  every ``lease_timeout / 3`` seconds (the same rules as a Session's lease under
  ``leases/``, on a separate prefix so the queue needs no Session), and writes the leaving
  beat when it ends. A claimant is *gone* when its newest beat is the leaving beat, or
  when the beat has not changed for ``lease_timeout`` seconds on the observer's own
  monotonic clock and the observer has watched that claim for as long (no server clock is
  ever read). Use the same ``lease_timeout`` on every node.
- **Restart.** A node that restarts with the same learner ID re-owns its own claims that
  are not done: it claims the next attempt itself, so the re-ownership cannot race another
  node's re-claim. Units it finished in an earlier life are skipped.
- **Re-claim.** After its pass over the units, a node watches the units that are neither
  done nor its own. When one's owner is gone, it claims the next attempt; whoever wins
  loads the unit (unless its done marker appeared meanwhile).
- **End.** Iteration ends when every unit is done, whoever did it. So a node that runs
  out of units of its own waits (polling every ``poll_interval`` seconds) for the others'
  last units, and takes over those whose owner is gone. After the loop, every unit is done,
  as long as one node kept iterating. (A node waiting there with a Session open stays
  live without publishing: other nodes' rounds close after ``round_timeout``.)

Each unit is thus *completed* (done marker written) exactly once, by the node that
trained on all of its batches. A node that stops in the middle of a unit leaves it to be
loaded again from the start by its next owner, so the batches it had already taken are
trained on twice; a node cut off from the mailbox for longer than ``lease_timeout`` may
likewise see its unit re-claimed while it still holds batches of it.

A unit ID serves once per run, like a barrier name: a loop over epochs names its units
after the epoch (``f"epoch-{e}.shard-{i}"``), and a new run uses a new mailbox prefix.

Errors
------

``shared_queue`` calls the mailbox directly: any error of a claim, listing or done marker
(:class:`~gradientmail.MailboxUnavailable` included; there are no retries) ends the queue,
and the training loop receives it after the batches already buffered. An exception from
``load`` ends the queue the same way (the unit stays claimed, not done). Only the lease
beats are retried with backoff for up to one beat interval, like a Session's: if renewal
keeps failing the queue ends, since its claims are no longer protected.

A queue whose loop stops early should be closed (``with shared_queue(...) as batches:`` or
``.close()``); a queue that is garbage-collected closes itself. Closing writes the done
markers of finished units and the leaving beat, so other nodes re-claim the rest at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from gradientmail.coord.claims import NEXT, WAIT, ClaimSeries, Verdict, judged
from gradientmail.coord.heartbeat import Heartbeat
from gradientmail.coord.leases import LeaseTracker
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.patterns._keys import check_count, check_seconds, check_segment
from gradientmail.wire import LEASES, check_learner_id

__all__ = [
    "DONE",
    "QUEUE_LEASES",
    "RECLAIMS",
    "UNITS",
    "SharedQueue",
    "claim",
    "claim_key",
    "done_key",
    "shared_queue",
]

B = TypeVar("B")
T = TypeVar("T")

UNITS = "units/"
RECLAIMS = "units-reclaims/"
DONE = "units-done/"
QUEUE_LEASES = "units-leases/"
_ATTEMPT_WIDTH = 4
_BEAT_WIDTH = 10
_UNIT_ROOM = len(RECLAIMS) + 1 + _ATTEMPT_WIDTH  # the longest key built from a unit ID
_CLOSE_TIMEOUT = 120.0
_FEW = 8  # up to this many units waited for: read their done markers rather than list all


def claim_key(unit: str, attempt: int = 0) -> str:
    """The key of ``unit``'s claim number ``attempt``: ``units/{unit}`` for the first."""
    if attempt == 0:
        return f"{UNITS}{unit}"
    return f"{RECLAIMS}{unit}/{attempt:0{_ATTEMPT_WIDTH}d}"


def done_key(unit: str) -> str:
    """``units-done/{unit}``: written once the unit's batches were all trained on."""
    return f"{DONE}{unit}"


async def claim(mailbox: Mailbox, unit: str, learner_id: str, attempt: int = 0) -> bool:
    """The claim expression: create ``unit``'s claim ``attempt`` naming ``learner_id``.

    For the first claim this is exactly spec 004's
    ``put_if_absent(f"units/{unit}", learner_id.encode())``. ``True`` means this call won
    the unit. Only an atomic create-once store makes the winner unique.
    """
    return await mailbox.put_if_absent(claim_key(unit, attempt), learner_id.encode())


def _holder(key: str, data: bytes | None) -> str:
    if data is None:
        raise ProtocolError(f"{key}: put_if_absent said it exists, but it reads as missing")
    try:
        return check_learner_id(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(
            f"{key}: a unit claim must hold a learner ID, not {data[:60]!r}"
        ) from None


# -- the buffer between the loader thread and the training loop ------------------------------


@dataclass(frozen=True)
class _Batch(Generic[B]):
    unit: str
    batch: B


@dataclass(frozen=True)
class _UnitEnd:
    unit: str
    attempt: int


@dataclass(frozen=True)
class _Finished:
    pass


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_Item = _Batch[B] | _UnitEnd | _Finished | _Failed


class _Buffer(Generic[B]):
    """A FIFO holding at most ``capacity`` batches (unit ends and the final item are free).

    The first :meth:`end` closes it to producers; the consumer still takes everything that
    was put before, then the final item.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: deque[_Item[B]] = deque()
        self._batches = 0
        self._closed = False
        self._cond = threading.Condition()

    def put_batch(self, unit: str, batch: B) -> bool:
        with self._cond:
            while self._batches >= self._capacity and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(_Batch(unit, batch))
            self._batches += 1
            self._cond.notify_all()
            return True

    def put_unit_end(self, unit: str, attempt: int) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._items.append(_UnitEnd(unit, attempt))
            self._cond.notify_all()
            return True

    def end(self, item: _Finished | _Failed) -> None:
        with self._cond:
            if not self._closed:
                self._items.append(item)
                self._closed = True
            self._cond.notify_all()

    def get(self) -> _Item[B]:
        with self._cond:
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
            if isinstance(item, _Batch):
                self._batches -= 1
            self._cond.notify_all()
            return item


class _Stopped(Exception):
    """The queue was closed; the producer leaves quietly."""


# -- the background side -----------------------------------------------------------------------


class _Worker(Generic[B]):
    """Two daemon threads: an event loop for mailbox calls, lease beats and done markers,
    and the producer, which claims and loads units (blocking in ``load`` and on the buffer).

    It holds no reference to its :class:`SharedQueue`, so a dropped queue can be finalized.
    """

    def __init__(
        self,
        units: tuple[str, ...],
        box: Mailbox,
        learner: str,
        load: Callable[[str], Iterable[B]],
        prefetch: int,
        poll_interval: float,
        lease_timeout: float,
    ) -> None:
        self.units = units
        self.box = box
        self.learner = learner
        self.load = load
        self.poll_interval = poll_interval
        self.lease_timeout = lease_timeout
        self.beat_interval = lease_timeout / 3
        # The observer's clock, for judging other nodes' leases only (tests inject one);
        # deadlines of this node's own mailbox calls are on time.monotonic, as retrying's.
        self.clock: Callable[[], float] = time.monotonic
        self.buffer: _Buffer[B] = _Buffer(prefetch)
        self.stopping = threading.Event()  # the producer must stop
        self._closing = threading.Event()  # the queue is shutting down: no more beats
        self.loaded: list[str] = []
        self.reclaimed: list[str] = []
        self.completed: list[str] = []
        self._mine: set[str] = set()  # claim keys won in this life
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._marks: asyncio.Queue[tuple[str, int] | None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # The queue's own lease (``units-leases/``): its beats name the learner.
        self._heartbeat = Heartbeat(
            self.box, QUEUE_LEASES, learner, lambda leaving: learner.encode(), self.beat_interval
        )
        self._producer: threading.Thread | None = None
        self._shutdown_future: Future[BaseException | None] | None = None

    # threads

    def start(self) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(
            target=self._run_loop, name=f"gradientmail-queue-io-{self.learner}", daemon=True
        ).start()
        producer = threading.Thread(
            target=self._produce_main, name=f"gradientmail-queue-load-{self.learner}", daemon=True
        )
        self._producer = producer
        producer.start()

    def _run_loop(self) -> None:
        assert self._loop is not None
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the I/O loop from the producer thread."""
        if self.stopping.is_set():
            coro.close()
            raise _Stopped
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def fail(self, error: BaseException) -> None:
        """End the queue with ``error`` after what is buffered; the first error wins."""
        with self._lock:
            if self._error is None:
                self._error = error
        self.stopping.set()  # claim nothing more; the lease lives on until the queue closes
        self.buffer.end(_Failed(error))

    # the producer

    def _produce_main(self) -> None:
        try:
            self._call(self._start_lease())
            self._produce()
            self.buffer.end(_Finished())
        except _Stopped:
            self.buffer.end(_Finished())
        except BaseException as exc:
            self.fail(exc)

    def _produce(self) -> None:
        pending: list[str] = []
        for unit in self.units:
            attempt = self._take(unit)
            if attempt is None:
                pending.append(unit)
            else:
                self._load(unit, attempt)
        self._trail(pending)

    def _take(self, unit: str) -> int | None:
        """First pass: claim ``unit``; the attempt won, or None when it is not ours."""
        if self._call(claim(self.box, unit, self.learner)):
            self._mine.add(claim_key(unit))
            return 0
        claims = self._claims(unit)
        if self._call(claims.holder(0)) != self.learner:
            return None
        # Our own claim from an earlier life of this learner.
        if self._call(self.box.get(done_key(unit))) is not None:
            return None  # finished then: the trailing pass sees it done
        attempts = self._call(self.box.list(f"{RECLAIMS}{unit}/"))
        newest = max((_parse_reclaim(key)[1] for key in attempts), default=0)
        return self._retake(unit, claims, newest, None)

    def _claims(self, unit: str) -> ClaimSeries:
        """``unit``'s claims, as this node watches them (each request made once)."""

        async def holder_of(key: str) -> str:
            return _holder(key, await self.box.get(key))

        return ClaimSeries(
            self.box,
            self.learner,
            partial(claim_key, unit),
            record=self.learner.encode(),
            holder_of=holder_of,
            what=f"unit {unit}",
            clock=self.clock,
            call=None,
        )

    def _retake(
        self, unit: str, claims: ClaimSeries, newest: int, tracker: LeaseTracker | None
    ) -> int | None:
        """One look at ``unit``'s newest claim: the attempt this node re-claimed, or None."""
        won = self._call(claims.take(newest, partial(self._decide, claims, tracker)))
        if won is not None:
            self._mine.add(claims.key_of(won))
            self.reclaimed.append(unit)
        return won

    def _load(self, unit: str, attempt: int) -> None:
        if self.stopping.is_set():
            raise _Stopped
        self.loaded.append(unit)
        for batch in self.load(unit):
            if not self.buffer.put_batch(unit, batch):
                raise _Stopped
        if not self.buffer.put_unit_end(unit, attempt):
            raise _Stopped

    def _trail(self, pending: list[str]) -> None:
        """Wait for the units of others until each is done; take over those whose owner left."""
        tracker = LeaseTracker(self.lease_timeout, clock=self.clock)
        watched: dict[str, ClaimSeries] = {}
        while pending:
            if self.stopping.is_set():
                raise _Stopped
            pending = self._not_done(pending)
            if not pending:
                return
            beats = self._call(self.box.list(QUEUE_LEASES))
            tracker.observe(LEASES + key[len(QUEUE_LEASES) :] for key in beats)
            newest: dict[str, int] = {}
            for key in self._call(self.box.list(RECLAIMS)):
                unit, attempt = _parse_reclaim(key)
                newest[unit] = max(attempt, newest.get(unit, 0))
            took = False
            for unit in pending:
                if unit not in watched:
                    watched[unit] = self._claims(unit)
                won = self._retake(unit, watched[unit], newest.get(unit, 0), tracker)
                if won is None:
                    continue
                pending.remove(unit)
                if self._call(self.box.get(done_key(unit))) is None:
                    self._load(unit, won)
                took = True
                break  # loading took a while: look at everything afresh
            if not took and self.stopping.wait(self.poll_interval):
                raise _Stopped

    def _not_done(self, units: list[str]) -> list[str]:
        """The units among ``units`` without a done marker: one listing, or a few reads."""
        if len(units) > _FEW:
            done = {key[len(DONE) :] for key in self._call(self.box.list(DONE))}
            return [unit for unit in units if unit not in done]
        return [unit for unit in units if self._call(self.box.get(done_key(unit))) is None]

    async def _decide(
        self,
        claims: ClaimSeries,
        tracker: LeaseTracker | None,
        attempt: int,
        holder: str | None,
        held: float,
    ) -> Verdict:
        """A unit's newest claim: ours in this life is kept; an earlier life's is taken
        over at once; another node's once its owner is gone (module docstring), judged by
        ``tracker`` (None: the first pass, which leaves others' claims to the trailing one)."""
        if claims.key_of(attempt) in self._mine:
            return WAIT  # being loaded by this node
        if holder == self.learner:
            return NEXT  # an earlier life of this learner
        if tracker is None:
            return WAIT
        return judged(tracker, holder, held, leaving=True)

    # the I/O loop: lease and done markers

    async def _start_lease(self) -> None:
        # An earlier life's beats (its leaving beat among them) go; numbers continue.
        await self._heartbeat.start(deadline=time.monotonic() + self.lease_timeout)
        if self._closing.is_set():
            return
        self._marks = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(
                self._heartbeat.run(self._closing, self.fail, give_up=True, clock=time.monotonic)
            ),
            asyncio.create_task(self._mark_loop()),
        ]

    async def _mark_loop(self) -> None:
        assert self._marks is not None
        while (item := await self._marks.get()) is not None:
            unit, attempt = item
            record = json.dumps({"learner": self.learner, "attempt": attempt}, sort_keys=True)
            try:
                # False: someone marked it first (a node that was cut off); it is done.
                if await self.box.put_if_absent(done_key(unit), record.encode()):
                    self.completed.append(unit)
            except Exception as exc:
                self.fail(exc)

    def unit_done(self, unit: str, attempt: int) -> None:
        """Called on the training thread when every batch of ``unit`` was taken."""
        loop, marks = self._loop, self._marks
        if loop is not None and marks is not None:
            loop.call_soon_threadsafe(marks.put_nowait, (unit, attempt))

    # shutting down

    def shutdown(self) -> Future[BaseException | None] | None:
        """Stop producing; flush done markers, leave, stop the threads. Returns a future of
        the first error, or None when the queue never started."""
        with self._lock:
            if self._shutdown_future is not None:
                return self._shutdown_future
            self._closing.set()
            self.stopping.set()
            self.buffer.end(_Finished())  # wakes a producer blocked on a full buffer
            if self._loop is None:
                return None
            try:
                self._shutdown_future = asyncio.run_coroutine_threadsafe(
                    self._shutdown(), self._loop
                )
            except RuntimeError:  # the loop is gone (interpreter exit)
                return None
            return self._shutdown_future

    async def _shutdown(self) -> BaseException | None:
        if self._marks is not None:
            self._marks.put_nowait(None)
        for task in self._tasks[1:]:
            await task  # the done markers of every unit that was finished
        for task in self._tasks[:1]:
            task.cancel()
        if self._heartbeat.number >= 0:
            with contextlib.suppress(Exception):  # else the lease lapses on its own
                await self._heartbeat.leave(deadline=time.monotonic() + self.beat_interval)
        asyncio.get_running_loop().create_task(self._stop_after_producer())
        return self._error

    async def _stop_after_producer(self) -> None:
        # The producer may still be inside load(); the loop serves it until it returns.
        while self._producer is not None and self._producer.is_alive():
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        asyncio.get_running_loop().stop()


def _parse_reclaim(key: str) -> tuple[str, int]:
    unit, _, attempt = key[len(RECLAIMS) :].rpartition("/")
    if not unit or len(attempt) != _ATTEMPT_WIDTH or not attempt.isdigit():
        raise ProtocolError(f"{key!r} is not a unit re-claim key")
    return unit, int(attempt)


# -- the training-loop side ------------------------------------------------------------------


class SharedQueue(Iterator[B]):
    """Iterate the batches of the units this node wins; see the module docstring.

    Built by :func:`shared_queue` (which checks its arguments). Iterating starts the
    background threads; iteration ends when every unit of the run is done. A context
    manager: leaving the ``with`` block (or :meth:`close`) stops early and lets other nodes
    take over this node's unfinished units.
    """

    def __init__(self, units: tuple[str, ...], learner_id: str, worker: _Worker[B]) -> None:
        self.units: tuple[str, ...] = units
        self.learner_id = learner_id
        self._worker = worker
        self._started = False
        self._ended = False
        self._finalizer = weakref.finalize(self, self._worker.shutdown)

    @property
    def loaded(self) -> Sequence[str]:
        """The units this node won and loaded, in order (re-claimed ones included)."""
        return tuple(self._worker.loaded)

    @property
    def reclaimed(self) -> Sequence[str]:
        """The units this node took over from a gone owner or an earlier life of its own."""
        return tuple(self._worker.reclaimed)

    @property
    def completed(self) -> Sequence[str]:
        """The units whose done marker this node wrote."""
        return tuple(self._worker.completed)

    def __iter__(self) -> SharedQueue[B]:
        return self

    def __next__(self) -> B:
        if self._ended:
            raise StopIteration
        if not self._started:
            self._started = True
            self._worker.start()
        while True:
            item = self._worker.buffer.get()
            if isinstance(item, _Batch):
                return item.batch
            if isinstance(item, _UnitEnd):
                self._worker.unit_done(item.unit, item.attempt)
                continue
            error = self._end()
            if isinstance(item, _Failed):
                raise item.error
            if error is not None:
                raise error
            raise StopIteration

    def close(self) -> None:
        """Stop early: unfinished units are left for other nodes (a leaving beat)."""
        if not self._ended:
            self._end()

    def _end(self) -> BaseException | None:
        self._ended = True
        self._finalizer.detach()
        future = self._worker.shutdown()
        if future is None:
            return None
        try:
            error: BaseException | None = future.result(timeout=_CLOSE_TIMEOUT)
        except TimeoutError:
            return TimeoutError(
                f"shared queue of {self.learner_id!r}: closing took over {_CLOSE_TIMEOUT:.0f} s"
            )
        return error

    def __enter__(self) -> SharedQueue[B]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Leaving the ``with`` block, however, stops early (:meth:`close`)."""
        self.close()


def shared_queue(
    units: Iterable[str],
    *,
    mailbox: Mailbox,
    learner_id: str,
    load: Callable[[str], Iterable[B]],
    prefetch: int = 4,
    poll_interval: float = 1.0,
    lease_timeout: float = 15.0,
) -> SharedQueue[B]:
    """The batches of the units this node wins, from a background prefetch buffer.

    ``units`` are the run's unit IDs, the same list in the same order on every node (each
    a single key segment, unique). ``load(unit)`` returns an iterable of batches; it runs
    on a background thread, and at most ``prefetch`` batches wait in the buffer.
    ``poll_interval`` paces the wait for other nodes' last units, and ``lease_timeout`` is
    how long a node's claims outlive its last lease beat (the same on every node). Any
    mailbox error, or an exception from ``load``, ends the iteration after the buffered
    batches. Nothing touches the mailbox before the first ``next()``.
    """
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"mailbox must implement gm.Mailbox, not {type(mailbox).__name__}")
    if isinstance(units, str | bytes):
        raise TypeError("units must be an iterable of unit IDs, not a single string")
    if not callable(load):
        raise TypeError(f"load must be callable, not {type(load).__name__}")
    learner = check_learner_id(learner_id)
    ids = tuple(check_segment(unit, "unit ID", room=_UNIT_ROOM) for unit in units)
    seen: set[str] = set()
    for unit in ids:
        if unit in seen:
            raise ValueError(f"unit ID {unit!r} appears twice; unit IDs must be unique")
        seen.add(unit)
    poll = check_seconds(poll_interval, "poll_interval")
    lease = check_seconds(lease_timeout, "lease_timeout")
    worker: _Worker[B] = _Worker(
        ids, mailbox, learner, load, check_count(prefetch, "prefetch"), poll, lease
    )
    return SharedQueue(ids, learner, worker)
