"""A mailbox wrapper that counts requests and bytes by operation and key kind."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from gradientmail.events import Counters
from gradientmail.mailbox import Mailbox


def _kind(key: str) -> str:
    head = key.partition("/")[0]
    return head or "root"


class Metered(Mailbox):
    def __init__(self, inner: Mailbox, counters: Counters, lock: threading.Lock) -> None:
        self.inner = inner
        self._counters = counters
        self._lock = lock

    def _count(self, op: str, kind: str, up: int = 0, down: int = 0) -> None:
        with self._lock:
            name = f"{op}:{kind}"
            self._counters.requests[name] = self._counters.requests.get(name, 0) + 1
            if up:
                self._counters.bytes_up[kind] = self._counters.bytes_up.get(kind, 0) + up
            if down:
                self._counters.bytes_down[kind] = self._counters.bytes_down.get(kind, 0) + down

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        self._count("put", _kind(key), up=len(data))
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str) -> bytes | None:
        data = await self.inner.get(key)
        self._count("get", _kind(key), down=len(data or b""))
        return data

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self._count("list", _kind(prefix))
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        self._count("delete", "any")
        await self.inner.delete(keys)
