"""Fault injectors that wrap any mailbox; the library itself never contains test hooks.

- :class:`FaultyMailbox`: chosen calls fail with :class:`MailboxUnavailable`, either before
  reaching the store or after the store applied them (a lost response: the outcome of the
  write is unknown to the caller, which is what a timeout looks like in production).
- :class:`SlowMailbox`: adds latency to every call, with an injectable sleep.
- :class:`CheckThenWriteMailbox`: a deliberately broken :class:`MemoryMailbox` whose
  ``put_if_absent`` checks, pauses, then writes, as a store without conditional writes
  would. The create-once race check must catch it.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Self, TypeVar

from gradientmail.errors import MailboxUnavailable
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.memory import MemoryMailbox

__all__ = ["CheckThenWriteMailbox", "FaultyMailbox", "Injection", "SlowMailbox"]

Op = Literal["put_if_absent", "get", "list", "delete"]
OPS: tuple[Op, ...] = ("put_if_absent", "get", "list", "delete")
Kind = Literal["before", "lost"]
T = TypeVar("T")


@dataclass(frozen=True)
class Injection:
    """One injected failure: which operation, its 1-based call number, and how it failed."""

    op: Op
    call: int
    kind: Kind
    key: str | None


class FaultyMailbox(Mailbox):
    """Wrap ``inner`` and make chosen calls fail with :class:`MailboxUnavailable`.

    ``fail_before("get", 2)`` fails the second ``get`` without touching the store;
    ``lose_response("put_if_absent", 1, 3)`` applies the first and third puts to the store
    and then raises, so the caller cannot know they succeeded. ``randomly(rate, seed=)``
    loses responses of any operation at random, reproducibly. Every injection is recorded
    in :attr:`injected`; :attr:`calls` counts calls per operation.
    """

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.injected: list[Injection] = []
        self._plan: dict[tuple[str, int], Kind] = {}
        self._random: random.Random | None = None
        self._rate = 0.0
        self._lock = threading.Lock()

    def fail_before(self, op: Op, *calls: int) -> Self:
        return self._schedule(op, calls, "before")

    def lose_response(self, op: Op, *calls: int) -> Self:
        return self._schedule(op, calls, "lost")

    def randomly(self, rate: float, *, seed: int) -> Self:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], not {rate}")
        self._random = random.Random(seed)
        self._rate = rate
        return self

    def _schedule(self, op: Op, calls: Iterable[int], kind: Kind) -> Self:
        if op not in OPS:
            raise ValueError(f"unknown mailbox operation {op!r}; one of {OPS}")
        for call in calls:
            if call < 1:
                raise ValueError(f"call numbers start at 1, not {call}")
            self._plan[(op, call)] = kind
        return self

    def _next(self, op: Op, key: str | None) -> Kind | None:
        with self._lock:
            self.calls[op] += 1
            call = self.calls[op]
            kind = self._plan.pop((op, call), None)
            if kind is None and self._random is not None and self._random.random() < self._rate:
                kind = "lost"
            if kind is not None:
                self.injected.append(Injection(op, call, kind, key))
            return kind

    async def _run(self, op: Op, key: str | None, action: Callable[[], Awaitable[T]]) -> T:
        kind = self._next(op, key)
        if kind == "before":
            raise MailboxUnavailable(
                f"injected: {op} call {self.calls[op]} failed before the store"
            )
        result = await action()
        if kind == "lost":
            raise MailboxUnavailable(f"injected: {op} call {self.calls[op]} lost its response")
        return result

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self._run("put_if_absent", key, lambda: self.inner.put_if_absent(key, data))

    async def get(self, key: str) -> bytes | None:
        return await self._run("get", key, lambda: self.inner.get(key))

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        return await self._run("list", prefix, lambda: self.inner.list(prefix, after=after))

    async def delete(self, keys: Iterable[str]) -> None:
        doomed = tuple(keys)
        await self._run("delete", None, lambda: self.inner.delete(doomed))


class SlowMailbox(Mailbox):
    """Wrap ``inner`` and wait ``delay`` seconds (per operation if a dict) before each call.

    ``sleep`` is injectable so tests can use a fake clock instead of real waiting.
    """

    def __init__(
        self,
        inner: Mailbox,
        delay: float | dict[str, float],
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.inner = inner
        self._delay = delay
        self._sleep = sleep

    async def _wait(self, op: Op) -> None:
        delay = self._delay.get(op, 0.0) if isinstance(self._delay, dict) else self._delay
        if delay > 0:
            await self._sleep(delay)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        await self._wait("put_if_absent")
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str) -> bytes | None:
        await self._wait("get")
        return await self.inner.get(key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        await self._wait("list")
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        await self._wait("delete")
        await self.inner.delete(keys)


class CheckThenWriteMailbox(MemoryMailbox):
    """A broken store: ``put_if_absent`` checks for the key, pauses, then writes.

    Two callers can both see the key missing and both "create" it, the later write silently
    replacing the earlier one; reading back cannot detect this. It exists so that tests
    prove the create-once checks would catch a store without atomic conditional writes.
    """

    def __init__(self, name: str = "", *, pause: float = 0.005) -> None:
        super().__init__(name)
        self.pause = pause

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if await self.get(key) is not None:
            return False
        await asyncio.sleep(self.pause)  # the window in which another writer slips in
        with self._lock:
            if key not in self._objects:
                self._sorted.append(key)
                self._sorted.sort()
            self._objects[key] = bytes(data)
        return True
