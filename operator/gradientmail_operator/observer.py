"""A run's mailbox, read for its status: apart from pod reconciliation, on its own loop.

Every mailbox call runs on one event loop in a thread of its own (:class:`MailboxLoop`),
whose default executor is not kopf's: a store that hangs holds those threads only, and pod
replacement, which runs on kopf's loop and the Kubernetes pool (``kube.py``), goes on.

:class:`Observer` keeps one run's :class:`~gradientmail.inspect.RunWatcher` and gives one
:class:`Observation` per poll. Each poll has a time budget: past it the poll keeps running
in the background (no second one is started for the run) and the observation says so.

The credentials Secret is read only when the watcher is (re)built: at the first poll, after
a ``MailboxConfigError`` (a rotated or wrong key), and when the Secret's resourceVersion
changed, which is checked at most every ``secret_check`` seconds. A run with
``mailbox.pollStatus: false`` is never polled and its Secret never read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gradientmail as gm
from gradientmail.inspect import RunView, RunWatcher
from gradientmail.launch.runspec import GradientMailRunSpec
from gradientmail_operator.kube import Credentials
from gradientmail_operator.reconcile import Reason
from gradientmail_operator.status import sync_condition, sync_warnings, view_status

T = TypeVar("T")

Condition = tuple[bool | None, Reason, str]


class MailboxLoop:
    """An event loop on a daemon thread, with an executor of its own, for mailbox calls."""

    def __init__(self, workers: int = 16) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="gm-mailbox")
        )
        threading.Thread(target=self._loop.run_forever, name="gm-mailbox-loop", daemon=True).start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)


_shared: MailboxLoop | None = None


def shared_loop() -> MailboxLoop:
    global _shared
    if _shared is None:
        _shared = MailboxLoop()
    return _shared


@dataclass(frozen=True)
class Observation:
    """What one poll found, ready to fold into the status."""

    status: dict[str, Any] = field(default_factory=dict)  # view_status() fields
    reachable: Condition | None = None  # MailboxReachable
    progressing: Condition | None = None  # the training part of Progressing
    synced: Condition | None = None  # SyncPointsContributed
    warnings: tuple[tuple[Reason, str], ...] = ()
    view: RunView | None = None


DISABLED = Observation()


CredentialsFn = Callable[[], Awaitable[Credentials | None]]
"""Reads the run's Secret (``None``: the run names none); raises ``LookupError``."""


class Observer:
    """One run's mailbox watcher, credentials and in-flight poll."""

    def __init__(
        self,
        *,
        budget: float = 30.0,
        secret_check: float = 60.0,
        loop: MailboxLoop | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget = budget
        self.secret_check = secret_check
        self._loop = loop
        self._clock = clock
        self._watcher: RunWatcher | None = None
        self._url: str | None = None
        self._version: str | None = None  # the Secret's resourceVersion behind the watcher
        self._checked_at = -1e18
        self._inflight: concurrent.futures.Future[RunView] | None = None
        self._started_at = 0.0
        self._warned: set[tuple[Reason, str]] = set()
        self.secret_reads = 0

    async def observe(
        self, spec: GradientMailRunSpec, url: str, credentials: CredentialsFn
    ) -> Observation:
        if not getattr(spec.mailbox, "poll_status", True):
            self._watcher = None
            return DISABLED
        if self._inflight is not None and not self._inflight.done():
            took = self._clock() - self._started_at
            return Observation(
                reachable=(
                    False,
                    Reason.POLL_TIMED_OUT,
                    f"a mailbox poll of {url} has been running for {took:.0f} s (budget "
                    f"{self.budget:.0f} s): the store answers slowly or not at all",
                )
            )
        try:
            watcher = await self._watcher_for(url, credentials)
        except LookupError as exc:
            return Observation(reachable=(False, Reason.SECRET_MISSING, str(exc)))
        except ValueError as exc:
            return Observation(reachable=(False, Reason.MAILBOX_MISCONFIGURED, str(exc)))
        loop = self._loop or shared_loop()
        self._inflight = loop.submit(watcher.poll())
        self._started_at = self._clock()
        try:
            view = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(self._inflight)), self.budget
            )
        except TimeoutError:
            return Observation(
                reachable=(
                    False,
                    Reason.POLL_TIMED_OUT,
                    f"a mailbox poll of {url} took longer than its budget of "
                    f"{self.budget:.0f} s; it goes on in the background",
                )
            )
        except gm.MailboxConfigError as exc:
            self._watcher = None  # rebuilt, with the Secret read again, at the next poll
            return Observation(reachable=(False, Reason.MAILBOX_MISCONFIGURED, str(exc)))
        except gm.MailboxError as exc:
            return Observation(reachable=(False, Reason.MAILBOX_UNREACHABLE, str(exc)))
        return self._fold(view)

    async def _watcher_for(self, url: str, credentials: CredentialsFn) -> RunWatcher:
        now = self._clock()
        due = (
            self._watcher is None or self._url != url or now - self._checked_at >= self.secret_check
        )
        if not due and self._watcher is not None:
            return self._watcher
        self._checked_at = now
        self.secret_reads += 1
        read = await credentials()
        version = None if read is None else read.version
        if self._watcher is not None and self._url == url and version == self._version:
            return self._watcher  # the Secret did not change: keep the watcher and its state
        values = {} if read is None else read.values
        box = gm.open_mailbox(url, **values)
        self._watcher, self._url, self._version = RunWatcher(box), url, version
        return self._watcher

    def _fold(self, view: RunView) -> Observation:
        training = view.rounds_committed > 0
        progress = f"{view.rounds_committed} rounds committed"
        if view.groups is not None:  # a Moshpit run: its group rounds (rounds_committed too)
            progress = f"groups: {view.groups.describe()}"
        return Observation(
            status=view_status(view),
            reachable=(True, Reason.MAILBOX_REACHABLE, "listing works"),
            progressing=(
                training,
                Reason.TRAINING if training else Reason.WAITING_FOR_ROUNDS,
                f"{progress}, {view.live_learners} learners live",
            ),
            synced=sync_condition(view),
            warnings=tuple(sync_warnings(view, self._warned)),
            view=view,
        )
