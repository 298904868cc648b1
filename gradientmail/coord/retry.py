"""Retrying transient mailbox failures: exponential backoff with full jitter, capped at 5 s.

Every protocol operation goes through :func:`retrying`: ``MailboxUnavailable`` is retried
for as long as it lasts (or until ``deadline`` / ``stop``), everything else propagates.

The wait before retry ``n`` (0-based) is drawn uniformly from ``[0, min(cap, first * 2**n)]``
("full jitter"): with the defaults, at most 0.5, 1, 2, 4, then 5 s, and half that on
average. Two reasons:

- **No lockstep.** Learners that failed together (one store outage) would otherwise retry
  together, forever: the store sees every node at once, then none. Each retry draws its
  own wait, from a random source seeded by the operating system in every process
  (injectable: ``rng``), so their retries spread over the whole interval.
- **A recovered store is used within seconds.** With the cap at 5 s, an operation is
  retried at most 5 s (2.5 s on average) after the store comes back; doubling to 30 s
  left learners idle for up to 29 s after a 30 s outage.

The clock, the sleep and the random source are injectable, so tests run without waiting.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gradientmail.errors import MailboxUnavailable

__all__ = ["FIRST_DELAY", "MAX_DELAY", "Stopped", "backoff", "retrying"]

T = TypeVar("T")

FIRST_DELAY = 0.5
"""Upper bound of the first wait, in seconds; each later bound doubles."""
MAX_DELAY = 5.0
"""Cap on every wait, in seconds."""

# SystemRandom reads the operating system's entropy: processes forked from one parent
# (which would share a seeded generator's state) still draw different waits.
_RANDOM: random.Random = random.SystemRandom()


class Stopped(Exception):
    """The owner asked the loop to stop while an operation was being retried."""


def backoff(retry: int, *, first: float, cap: float, rng: random.Random | None = None) -> float:
    """The wait before retry ``retry`` (0-based): uniform in ``[0, min(cap, first * 2**retry)]``."""
    ceiling = min(cap, first * 2.0 ** min(retry, 64))  # the exponent is bounded: no overflow
    return (_RANDOM if rng is None else rng).uniform(0.0, ceiling)


async def retrying(
    operation: Callable[[], Awaitable[T]],
    *,
    stop: threading.Event | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    first: float | None = None,
    cap: float | None = None,
    rng: random.Random | None = None,
) -> T:
    """Await ``operation()`` until it does not raise ``MailboxUnavailable``.

    Gives up (re-raising the last failure) once the next wait would pass ``deadline`` (on
    ``clock``), and raises :class:`Stopped` when ``stop`` is set.
    """
    # Read at call time, so a test can shorten the backoff for every operation at once.
    first = FIRST_DELAY if first is None else first
    cap = MAX_DELAY if cap is None else cap
    retry = 0
    while True:
        try:
            return await operation()
        except MailboxUnavailable:
            if stop is not None and stop.is_set():
                raise Stopped from None
            delay = backoff(retry, first=first, cap=cap, rng=rng)
            if deadline is not None and clock() + delay > deadline:
                raise
        # Sleep in small slices so a stop request is honoured quickly.
        end = clock() + delay
        while (left := end - clock()) > 0:
            if stop is not None and stop.is_set():
                raise Stopped
            await sleep(min(left, 0.1))
        retry += 1
