"""Between threads and event loops: running coroutines from synchronous code (even where a
loop is already running), and waking a loop from another thread at once."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``; from inside a running loop (a notebook), on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="gradientmail-call")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class Wake:
    """A flag any thread can raise that wakes, at once, the one event loop waiting on it.

    Polling a ``threading.Event`` from a loop (sleep, check, sleep) adds up to one sleep
    slice of delay to every hand-over between threads; here :meth:`set` also schedules the
    waiting loop's ``asyncio.Event`` through ``call_soon_threadsafe``.
    """

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def set(self) -> None:
        self._flag.set()  # first: a waiter that checks the flag after clearing sees it
        loop, event = self._loop, self._event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody waits
                loop.call_soon_threadsafe(event.set)

    def consume(self) -> bool:
        """True (and lowered) when raised since the last call."""
        if self._flag.is_set():
            self._flag.clear()
            return True
        return False

    async def wait(self, timeout: float) -> None:
        """Return when raised, or after ``timeout`` seconds; the flag stays for consume()."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._event is None:
            self._loop, self._event = loop, asyncio.Event()
        self._event.clear()
        if self._flag.is_set():  # raised before the clear above: do not wait for it
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
