"""The mailbox: the only thing GradientMail nodes share.

A mailbox is an object store reduced to four coroutines (:class:`Mailbox`). Everything in a
run (claims, the manifest, rounds, snapshots, leases, payloads, barrier arrivals, queue
units) is an object created once with :meth:`Mailbox.put_if_absent` and never replaced.

Files of this package:

- ``__init__.py``: the :class:`Mailbox` Protocol and what every backend must guarantee.
- ``_keys.py``: key and prefix validation shared by the built-in backends (before any I/O).
- ``_threaded.py``: :class:`ThreadedMailbox`, the four coroutines of a backend whose calls
  block (file, S3): keys checked first, then the call on a worker thread.
- ``memory.py``: :class:`MemoryMailbox`, a dict behind a lock; named instances for tests.
- ``file.py``: :class:`FileMailbox`, objects as files, create-once by hard-link staging.
- ``s3.py``: :class:`S3Mailbox`, any S3-compatible store through boto3 with
  ``If-None-Match: *`` conditional puts.
- ``url.py``: :func:`open_mailbox`, from ``s3://``, ``file://`` and ``memory://`` URLs.
- ``metered.py``: :class:`Metered`, a wrapper counting a Session's requests and bytes by kind.

The contract suite every backend must pass lives in :mod:`gradientmail.testing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from gradientmail.errors import (
    MailboxConfigError,
    MailboxError,
    MailboxUnavailable,
    PayloadCorrupt,
    ProtocolError,
)

__all__ = [
    "Mailbox",
    "MailboxConfigError",
    "MailboxError",
    "MailboxUnavailable",
    "PayloadCorrupt",
    "ProtocolError",
]


@runtime_checkable
class Mailbox(Protocol):
    """A shared object store with create-once writes.

    Keys are ``/``-separated UTF-8 strings relative to the run (a backend prepends its own
    prefix). A backend must guarantee:

    - **Atomic create-once writes**: for each key exactly one ``put_if_absent`` returns
      ``True``; no later call replaces the object.
    - **Whole objects**: a reader sees all of an object or nothing of it.
    - **Read-after-write and list-after-write**: once a write returns, every client sees the
      object through ``get`` and ``list``.
    - **Complete, ordered listings**: ``list`` returns every matching key, in UTF-8 byte
      order, across all pages of the underlying store.
    - **Idempotent deletes**: deleting a missing key is not an error.

    One instance serves several event loops on several threads, so a backend holds no
    asyncio primitive bound to one loop and runs blocking I/O in ``asyncio.to_thread``. It
    bounds its own requests (no ``asyncio.timeout`` around a store call: a cancelled
    ``to_thread`` leaves its thread running). Transient failures, and writes whose outcome
    is unknown, raise :class:`MailboxUnavailable`.

    Third-party backends may subclass this Protocol explicitly or just match its shape.
    """

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` holding ``data``; return whether this call created it.

        An existing object is left untouched and ``False`` is returned.
        """
        ...

    async def get(self, key: str) -> bytes | None:
        """Return the whole object stored at ``key``, or ``None`` if there is none."""
        ...

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        """Every key that starts with ``prefix`` and sorts after ``after``, in byte order."""
        ...

    async def delete(self, keys: Iterable[str]) -> None:
        """Remove every key in ``keys``; a key that does not exist is not an error."""
        ...
