"""An asyncio service (the API server, the kubelet) on a daemon thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable


class LoopThread:
    """Run ``astart()`` on a fresh event loop in a daemon thread, keep the loop running until
    :meth:`stop`, then run ``astop()`` there (also after a failed start)."""

    def __init__(
        self,
        name: str,
        astart: Callable[[], Awaitable[None]],
        astop: Callable[[], Awaitable[None]],
    ) -> None:
        self.name = name
        self._astart = astart
        self._astop = astop
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float) -> None:
        """Return once ``astart()`` finished; raise naming the error if it failed."""
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                self._stop_requested = asyncio.Event()
                loop.run_until_complete(self._astart())
                ready.set()
                loop.run_until_complete(self._stop_requested.wait())
            except BaseException as exc:
                self._error = exc
            finally:
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(self._astop())
                ready.set()
                loop.close()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or self._error is not None:
            self.stop(timeout)
            raise RuntimeError(f"the {self.name} did not start: {self._error!r}")

    def stop(self, timeout: float) -> None:
        """Ask the loop to finish and wait up to ``timeout`` s for it (idempotent)."""
        thread, loop, event = self._thread, self._loop, self._stop_requested
        if thread is None:
            return
        if loop is not None and event is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(event.set)
        thread.join(timeout)
        self._thread = None
