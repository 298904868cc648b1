"""MemoryMailbox: a dict behind a lock, for tests and single-process runs."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from gradientmail.mailbox import Mailbox
from gradientmail.mailbox._keys import check_after, check_key, check_keys, check_prefix

__all__ = ["MemoryMailbox"]


class MemoryMailbox(Mailbox):
    """Objects in a dict, safe across threads and event loops.

    The methods never await, so each runs to completion on whichever loop calls it; the
    lock serialises callers on different threads. A sorted key list is kept beside the
    dict, so ``list`` costs a binary search plus the keys returned.

    ``MemoryMailbox.named(name)`` returns one shared instance per name in this process
    (what ``open_mailbox("memory://name")`` uses). A memory mailbox cannot be shared with
    another process: pickling one raises ``TypeError`` rather than silently splitting the
    store in two.
    """

    _registry: ClassVar[dict[str, MemoryMailbox]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._objects: dict[str, bytes] = {}
        self._sorted: list[str] = []

    @classmethod
    def named(cls, name: str) -> MemoryMailbox:
        """The process-wide instance called ``name``, created on first use."""
        with cls._registry_lock:
            box = cls._registry.get(name)
            if box is None:
                box = cls._registry[name] = cls(name)
            return box

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def __repr__(self) -> str:
        return f"MemoryMailbox({self.name!r}, objects={len(self._objects)})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a MemoryMailbox lives in one process and cannot be sent to another; "
            "use a FileMailbox or S3Mailbox for multi-process runs"
        )

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        data = bytes(data)  # an immutable copy: the caller may reuse its buffer
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = data
            bisect.insort(self._sorted, key)
            return True

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            return self._objects.get(key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        check_after(after)
        # Python orders str by code point, which for valid Unicode is UTF-8 byte order.
        start = max(prefix, after)
        with self._lock:
            index = bisect.bisect_right(self._sorted, start)
            if start == prefix and prefix in self._objects and prefix > after:
                index -= 1  # the prefix itself is a key and qualifies
            found: list[str] = []
            for key in self._sorted[index:]:
                if not key.startswith(prefix):
                    break
                found.append(key)
            return found

    async def delete(self, keys: Iterable[str]) -> None:
        doomed = check_keys(keys)
        with self._lock:
            for key in doomed:
                if self._objects.pop(key, None) is not None:
                    del self._sorted[bisect.bisect_left(self._sorted, key)]
