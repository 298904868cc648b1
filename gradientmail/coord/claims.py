"""The claim-with-failover loop: one series of create-once claims, as one observer sees it.

Every elected role is a series of claims, attempt 0, 1, 2, … (``coord/election.py`` says
when one may be taken over): a round's closer, a Moshpit group's closer, the run's creator,
a Shared Queue unit. :class:`ClaimSeries` is the loop they share. Given the newest attempt
the caller listed, :meth:`ClaimSeries.take`

1. reads who holds it (once per attempt: a claim is never replaced),
2. measures how long this observer has watched it, on its own clock (from the first look),
3. asks the caller's ``decide`` whether the claim is this learner's to keep
   (:data:`HOLD`), still honoured (:data:`WAIT`) or no longer honoured (:data:`NEXT`),
4. and on :data:`NEXT` (or when there is no claim yet) creates the next attempt.

What differs between roles stays with the caller: the keys (``key_of``), how a holder is
read (``holder_of``), the retry policy of each request (``call``), the clock, and the
decision (a lease, a deadline, a give-up count, a leaving beat).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol, TypeVar

from gradientmail import wire as p
from gradientmail.coord.election import NOBODY, abandoned, claim_holder
from gradientmail.coord.leases import LeaseTracker
from gradientmail.coord.retry import retrying
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox

__all__ = [
    "HOLD",
    "MAX_ATTEMPT",
    "NEXT",
    "WAIT",
    "Caller",
    "ClaimSeries",
    "Verdict",
    "closer_claims",
    "judged",
]

_log = logging.getLogger("gradientmail")

T = TypeVar("T")

MAX_ATTEMPT = 10**4 - 1  # claim keys give the attempt four digits


class Verdict(enum.Enum):
    """What an observer makes of the newest claim of a series."""

    HOLD = "hold"  # this learner's: keep it (the attempt is returned)
    WAIT = "wait"  # someone's claim that is still honoured
    NEXT = "next"  # no longer honoured: claim the next attempt


HOLD, WAIT, NEXT = Verdict.HOLD, Verdict.WAIT, Verdict.NEXT


def judged(
    tracker: LeaseTracker,
    holder: str | None,
    held: float,
    *,
    deadline: float | None = None,
    leaving: bool = False,
) -> Verdict:
    """Someone else's claim (``holder`` None or :data:`~gradientmail.coord.election.NOBODY`:
    unreadable, a dead holder's), watched for ``held`` seconds: :data:`NEXT` once
    :func:`~gradientmail.coord.election.abandoned` says so, by ``tracker``'s leases (and the
    role's ``deadline``; ``leaving``: when a leaving beat of its holder counts at once)."""
    who = NOBODY if holder is None else holder
    lease = tracker.known().get(who) if leaving else None
    gone = abandoned(
        held=held,
        live=tracker.is_live(who),
        lease_timeout=tracker.lease_timeout,
        leaving=lease is not None and lease.leaving,
        deadline=deadline,
    )
    return NEXT if gone else WAIT


class Caller(Protocol):
    """How each request of the series is made (:func:`~gradientmail.coord.retry.retrying`
    by default; a deadline-bound retry for a joiner; a plain await for a Shared Queue)."""

    def __call__(self, operation: Callable[[], Awaitable[T]], /) -> Awaitable[T]: ...


async def _once(operation: Callable[[], Awaitable[T]], /) -> T:
    return await operation()


def _retried(operation: Callable[[], Awaitable[T]], /) -> Awaitable[T]:
    return retrying(operation)


class ClaimSeries:
    """One role's claims as one observer sees them (module docstring).

    ``key_of(attempt)``: the claim's key. ``record``: what this learner's claim holds.
    ``holder_of(key)``: who a claim names; None when it cannot be read yet (then it is read
    again next time), and a reader may raise instead. ``what`` names the role in logs and
    errors. ``call=None`` makes each request once, without retries.
    """

    def __init__(
        self,
        box: Mailbox,
        me: str,
        key_of: Callable[[int], str],
        *,
        record: bytes,
        holder_of: Callable[[str], Awaitable[str | None]],
        what: str,
        clock: Callable[[], float] = time.monotonic,
        call: Caller | None = _retried,
    ) -> None:
        self.box = box
        self.me = me
        self.key_of = key_of
        self.record = record
        self.holder_of = holder_of
        self.what = what
        self.clock = clock
        self.call: Caller = _once if call is None else call
        self.seen: dict[int, float] = {}  # attempt -> when this observer first saw it
        self.holders: dict[int, str] = {}  # attempt -> who holds it (read once each)

    async def holder(self, attempt: int) -> str | None:
        """Who holds claim ``attempt`` (None: not readable yet)."""
        if attempt not in self.holders:
            holder = await self.holder_of(self.key_of(attempt))
            if holder is None:
                return None
            self.holders[attempt] = holder
        return self.holders[attempt]

    def held(self, attempt: int) -> float:
        """How long this observer has watched claim ``attempt`` (0 at the first look)."""
        now = self.clock()
        return now - self.seen.setdefault(attempt, now)

    async def claim(self, attempt: int) -> bool:
        """Create claim ``attempt``; True when this learner holds it. A put that reports the
        key taken may be this learner's own earlier write whose response was lost: the
        claim names its writer, so reading it tells."""
        key = self.key_of(attempt)
        won = await self.call(partial(self.box.put_if_absent, key, self.record))
        self.seen.setdefault(attempt, self.clock())
        if won:
            self.holders[attempt] = self.me
            return True
        return await self.holder(attempt) == self.me

    async def take(
        self,
        newest: int | None,
        decide: Callable[[int, str | None, float], Awaitable[Verdict]],
    ) -> int | None:
        """The attempt this learner holds after one look, or None while someone else's
        claim is honoured (or another learner won the race for the next one). ``newest``:
        the newest attempt listed (None: no claim yet, attempt 0 is claimed).
        ``decide(attempt, holder, held)``: the caller's verdict on the newest claim, given
        its holder (None: unreadable so far) and how long this observer has watched it."""
        attempt = 0
        if newest is not None:
            holder = await self.holder(newest)
            held = self.held(newest)
            verdict = await decide(newest, holder, held)
            if verdict is HOLD:
                return newest
            if verdict is WAIT:
                return None
            attempt = newest + 1
            if attempt > MAX_ATTEMPT:
                raise ProtocolError(
                    f"{self.what}: every claim attempt up to {MAX_ATTEMPT} is used; "
                    "the claims are in a state no closer leaves them in: start a new run prefix"
                )
            _log.warning(
                "%s: claim %d of %s not honoured any longer (%.1f s); claiming %d",
                self.what,
                newest,
                holder or "an unreadable claim",
                held,
                attempt,
            )
        return attempt if await self.claim(attempt) else None


def closer_claims(
    box: Mailbox, me: str, key_of: Callable[[int], str], *, what: str, clock: Callable[[], float]
) -> ClaimSeries:
    """A closer's claims (a round's, a group's): :class:`~gradientmail.wire.Claim` records,
    each request retried."""
    return ClaimSeries(
        box,
        me,
        key_of,
        record=p.encode(p.Claim(me)),
        holder_of=partial(claim_holder, box),
        what=what,
        clock=clock,
    )
