"""The filesystem backend printed in spec 004 ("Implementing a mailbox backend"), unchanged.

It stands for a third-party backend: it subclasses ``gm.Mailbox`` and must pass the same
contract suite as the built-in backends (tests/conftest.py, "spec-filesystem"). Keep the
class below byte-for-byte as the spec prints it; if it stops working, the library broke
its public contract.
"""
import asyncio
import os
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import gradientmail as gm


class FileMailbox(gm.Mailbox):
    """Objects as files under ``root/objects``; the slashes of a key are directories."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._objects = Path(root) / "objects"
        self._staging = Path(root) / "staging"
        self._objects.mkdir(parents=True, exist_ok=True)
        self._staging.mkdir(parents=True, exist_ok=True)

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await asyncio.to_thread(self._put_if_absent, key, data)

    async def get(self, key: str) -> bytes | None:
        return await asyncio.to_thread(self._get, key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        return await asyncio.to_thread(self._list, prefix, after)

    async def delete(self, keys: Iterable[str]) -> None:
        await asyncio.to_thread(self._delete, tuple(keys))

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._objects / key
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = self._staging / uuid.uuid4().hex
        staged.write_bytes(data)
        try:
            # link() refuses an existing target, and the file appears complete or not at all.
            os.link(staged, target)
        except FileExistsError:
            return False
        finally:
            staged.unlink()
        return True

    def _get(self, key: str) -> bytes | None:
        try:
            return (self._objects / key).read_bytes()
        except FileNotFoundError:
            return None

    def _list(self, prefix: str, after: str) -> Sequence[str]:
        start = self._objects / prefix.rpartition("/")[0]
        keys = (
            (Path(directory) / name).relative_to(self._objects).as_posix()
            for directory, _, names in os.walk(start)
            for name in names
        )
        return sorted(key for key in keys if key.startswith(prefix) and key > after)

    def _delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            (self._objects / key).unlink(missing_ok=True)

