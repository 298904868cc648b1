"""The four coroutines of a backend whose store calls block (files, boto3): each checks its
keys before any I/O, then runs the blocking call on a worker thread, so an event loop never
waits on the disk or the network. A backend implements the four blocking methods."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Iterable, Sequence

from gradientmail.mailbox import Mailbox
from gradientmail.mailbox._keys import check_after, check_key, check_keys, check_prefix

__all__ = ["ThreadedMailbox"]


class ThreadedMailbox(Mailbox):
    """A :class:`Mailbox` made of four blocking methods run on worker threads."""

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        check_key(key)
        return await asyncio.to_thread(self._put_if_absent, key, data)

    async def get(self, key: str) -> bytes | None:
        check_key(key)
        return await asyncio.to_thread(self._get, key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        check_prefix(prefix)
        check_after(after)
        return await asyncio.to_thread(self._list, prefix, after)

    async def delete(self, keys: Iterable[str]) -> None:
        doomed = tuple(dict.fromkeys(check_keys(keys)))  # de-duplicated, order kept
        if doomed:
            await asyncio.to_thread(self._delete, doomed)

    @abc.abstractmethod
    def _put_if_absent(self, key: str, data: bytes) -> bool: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _list(self, prefix: str, after: str) -> Sequence[str]: ...

    @abc.abstractmethod
    def _delete(self, keys: Sequence[str]) -> None: ...
