"""Barrier: hold each node at a named point until ``parties`` nodes have reached it.

An arrival is the object ``barriers/{name}/{learner_id}``, created with ``put_if_absent``
and never removed. :meth:`Barrier.wait` creates this node's arrival, then lists
``barriers/{name}/`` every ``poll_interval`` seconds until the listing holds ``parties``
arrivals or more, and returns the learner IDs it listed. The listing is the whole state:
there is no leader and nothing to recover.

- **Restart-safe, counted once.** A node that restarts (or calls ``wait`` twice) finds its
  own arrival already there (``put_if_absent`` returns ``False``), so it is counted once
  and passes if the barrier opened meanwhile.
- **Late arrivals pass at once.** A node arriving after the barrier opened lists ``parties``
  arrivals or more on its first poll, right after recording its own.
- **Timeouts keep the arrival.** After ``timeout`` seconds ``wait`` raises
  :class:`TimeoutError`; the arrival stays, so calling ``wait`` again resumes waiting, and a
  node arriving later still finds it.
- **Transient failures** (:class:`~gradientmail.MailboxUnavailable`) are retried with
  jittered backoff (each wait drawn below 0.5 s doubling, capped at 5 s), as the
  protocol's own operations are; with a ``timeout``, an outage that outlasts it ends in
  :class:`TimeoutError` (its cause is the last failure). Other errors propagate at once.
- **Leases.** ``wait`` only blocks the calling thread. A :class:`~gradientmail.Session`
  renews its lease on a thread of its own, so a node waiting at a barrier with a Session
  open stays live (it publishes nothing meanwhile: see spec 000 on where to place barriers).

Because arrivals persist, a name serves once per run: name barriers after their iteration
(``f"epoch-{epoch}"``) and give a new run a new mailbox prefix. Names are single key
segments (no ``/``, not ``.``/``..``, no control characters), checked before any I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TypeVar

from gradientmail.coord.retry import retrying
from gradientmail.coord.threads import run_coroutine
from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox import Mailbox
from gradientmail.patterns._keys import check_count, check_seconds, check_segment, check_timeout
from gradientmail.wire import check_learner_id

__all__ = ["BARRIERS", "Barrier", "arrival_key"]

BARRIERS = "barriers/"
_LEARNER_ROOM = 128  # the longest learner ID, in bytes
T = TypeVar("T")


def arrival_key(name: str, learner_id: str) -> str:
    """``barriers/{name}/{learner_id}``: one node's arrival at barrier ``name``."""
    return f"{BARRIERS}{name}/{learner_id}"


class Barrier:
    """Line nodes up at named points of a run, through the mailbox alone.

    ``poll_interval`` is how often a waiting node lists the arrivals; every waiting node
    passes within one ``poll_interval`` of the last arrival. ``clock`` (monotonic seconds)
    and ``sleep`` (a coroutine function) exist for tests; they also pace the retries.
    """

    def __init__(
        self,
        *,
        mailbox: Mailbox,
        learner_id: str,
        poll_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not isinstance(mailbox, Mailbox):
            raise TypeError(f"mailbox must implement gm.Mailbox, not {type(mailbox).__name__}")
        self.mailbox = mailbox
        self.learner_id = check_learner_id(learner_id)
        self.poll_interval = check_seconds(poll_interval, "poll_interval")
        self._clock = clock
        self._sleep = sleep

    def wait(self, name: str, *, parties: int, timeout: float | None = None) -> list[str]:
        """Record this node's arrival at ``name`` and block until ``parties`` nodes arrived.

        Returns the learner IDs that had arrived when the barrier opened for this node (at
        least ``parties``, in byte order). Raises :class:`TimeoutError` after ``timeout``
        seconds; the arrival stays recorded, so calling ``wait`` again resumes. Safe to call
        from inside a running event loop (it then waits on a helper thread); coroutines
        should prefer :meth:`wait_async`.
        """
        self._check(name, parties, timeout)
        return run_coroutine(self.wait_async(name, parties=parties, timeout=timeout))

    async def wait_async(
        self, name: str, *, parties: int, timeout: float | None = None
    ) -> list[str]:
        """:meth:`wait` as a coroutine, for callers that run an event loop."""
        limit = self._check(name, parties, timeout)
        deadline = None if limit is None else self._clock() + limit
        prefix = f"{BARRIERS}{name}/"
        key = arrival_key(name, self.learner_id)
        # False means the arrival was already there: our own, from an earlier call or life.
        await self._retry(
            partial(self.mailbox.put_if_absent, key, self.learner_id.encode()),
            name,
            deadline,
            limit,
        )
        while True:
            keys = await self._retry(partial(self.mailbox.list, prefix), name, deadline, limit)
            arrived = _arrivals(keys, prefix)
            if len(arrived) >= parties:
                return arrived
            now = self._clock()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"barrier {name!r}: {len(arrived)} of {parties} parties arrived within "
                    f"{limit:g} s ({', '.join(arrived) or 'none'}); the arrival of "
                    f"{self.learner_id!r} stays recorded, so wait() again resumes"
                )
            pause = (
                self.poll_interval if deadline is None else min(self.poll_interval, deadline - now)
            )
            await self._sleep(pause)

    def _check(self, name: object, parties: object, timeout: object) -> float | None:
        check_segment(name, "barrier name", room=len(BARRIERS) + 1 + _LEARNER_ROOM)
        check_count(parties, "parties")
        return check_timeout(timeout)

    async def _retry(
        self,
        operation: Callable[[], Awaitable[T]],
        name: str,
        deadline: float | None,
        limit: float | None,
    ) -> T:
        try:
            return await retrying(
                operation, deadline=deadline, clock=self._clock, sleep=self._sleep
            )
        except MailboxUnavailable as exc:
            # Only raised once the next retry would pass the deadline.
            raise TimeoutError(
                f"barrier {name!r}: the mailbox stayed unavailable until the {limit:g} s "
                f"timeout ({exc}); wait() again resumes"
            ) from exc


def _arrivals(keys: Sequence[str], prefix: str) -> list[str]:
    """The learner IDs among listed keys; objects that are not arrivals are ignored."""
    found: list[str] = []
    for key in keys:
        learner = key[len(prefix) :]
        try:
            found.append(check_learner_id(learner))
        except ValueError:
            continue
    return found
