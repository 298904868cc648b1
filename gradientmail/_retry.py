"""Retrying transient mailbox failures: backoff from 0.5 s doubling to 30 s.

Every protocol operation goes through :func:`retrying`: ``MailboxUnavailable`` is retried
for as long as it lasts (or until ``deadline`` / ``stop``), everything else propagates.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gradientmail.errors import MailboxUnavailable

T = TypeVar("T")

FIRST_DELAY = 0.5
MAX_DELAY = 30.0


class Stopped(Exception):
    """The owner asked the loop to stop while an operation was being retried."""


async def retrying(
    operation: Callable[[], Awaitable[T]],
    *,
    stop: threading.Event | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    first: float | None = None,
    cap: float | None = None,
) -> T:
    # Read at call time, so a test can shorten the backoff for every operation at once.
    delay = FIRST_DELAY if first is None else first
    cap = MAX_DELAY if cap is None else cap
    while True:
        try:
            return await operation()
        except MailboxUnavailable:
            if stop is not None and stop.is_set():
                raise Stopped from None
            if deadline is not None and clock() + delay > deadline:
                raise
        # Sleep in small slices so a stop request is honoured quickly.
        end = clock() + delay
        while (left := end - clock()) > 0:
            if stop is not None and stop.is_set():
                raise Stopped
            await sleep(min(left, 0.1))
        delay = min(delay * 2, cap)
