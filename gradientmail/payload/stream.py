"""Reading a payload as a stream of verified parts: memory bounded by a few parts, not by
the payload.

:func:`chunks` yields a payload's bytes in order, one verified blob (or part) at a time,
with at most ``window`` parts fetched ahead; a part is let go once the consumer took it.
:class:`Pieces` turns those chunks into element-aligned pieces of each tensor (1-D views
into the chunk), after validating the safetensors header (and the expected layout) before
any data is handed out. A tensor that straddles two parts comes as two pieces (an element
cut by the boundary is joined from its bytes on both sides).

:func:`stream_tensors` feeds every piece to a sink on a worker thread (a copy into a
destination, a weighted accumulation into a closer's sum); :func:`read_into` copies a
payload into given tensors. A failure part-way (a corrupt or missing part) raises after
the sink saw the earlier pieces: callers write only into buffers they can discard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from gradientmail.coord.retry import retrying
from gradientmail.errors import ObjectMissing, PayloadCorrupt, ProtocolError
from gradientmail.ledger import DOWNLOAD, LEDGER
from gradientmail.mailbox import Mailbox
from gradientmail.payload._format import MAX_HEADER, Entry, entries, view_of
from gradientmail.wire import TensorSpec, is_parts_key
from gradientmail.wire.parts import PartWire, parse_index, verify_blob

__all__ = [
    "WINDOW",
    "Pieces",
    "Sink",
    "chunks",
    "fixed",
    "read_into",
    "read_new",
    "stream_tensors",
    "workers",
]

WINDOW = 4
"""Parts fetched ahead of the one being consumed (each at most ``PART_BYTES``)."""
_VERIFY_ON_LOOP = 4 * 1024 * 1024  # smaller blobs are hashed on the loop, larger on a thread

# (tensor name, index of the piece's first element in the flattened tensor, 1-D piece)
Sink = Callable[[str, int, torch.Tensor], None]


async def _get(box: Mailbox, key: str, of: str | None, stop: threading.Event | None) -> bytes:
    data = await retrying(partial(box.get, key), stop=stop)
    if data is None:
        what = f"{of}: its part {key}" if of else key
        raise ObjectMissing(
            f"{what}: the payload is missing (swept, or written to a different store)"
        )
    return data


async def _verified(key: str, data: bytes) -> None:
    if len(data) < _VERIFY_ON_LOOP:
        verify_blob(key, data)
    else:
        await asyncio.to_thread(verify_blob, key, data)  # hashing releases the GIL


async def chunks(
    box: Mailbox,
    key: str,
    *,
    window: int = WINDOW,
    stop: threading.Event | None = None,
) -> AsyncGenerator[tuple[int, bytes], None]:
    """``(total size, chunk)`` for each verified chunk of the payload ``key``, in order.

    Transient store failures are retried per object (until ``stop``); a missing object is
    a :class:`ProtocolError`, one whose bytes do not match its name :class:`PayloadCorrupt`.
    Received bytes are charged to ``download`` in the ledger until the consumer moves on.
    """
    data = await _get(box, key, None, stop)
    if not is_parts_key(key):
        await _verified(key, data)
        with LEDGER.holding(DOWNLOAD, len(data)):
            yield len(data), data
        return
    parts = parse_index(key, data)
    total = sum(part["size"] for part in parts)

    async def fetch(part: PartWire) -> bytes:
        blob = await _get(box, part["key"], key, stop)
        if len(blob) != part["size"]:
            raise PayloadCorrupt(
                f"{key}: part {part['key']} holds {len(blob)} bytes, the index says {part['size']}"
            )
        await _verified(part["key"], blob)
        LEDGER.add(DOWNLOAD, len(blob))  # no await after this: charged iff the task is done
        return blob

    todo = iter(parts)
    ahead: deque[asyncio.Task[bytes]] = deque()

    def more() -> None:
        part = next(todo, None)
        if part is not None:
            ahead.append(asyncio.ensure_future(fetch(part)))

    for _ in range(max(1, window)):
        more()
    try:
        while ahead:
            blob = await ahead.popleft()
            more()
            try:
                yield total, blob
            finally:
                LEDGER.sub(DOWNLOAD, len(blob))
    finally:
        # Left early (a failure, the consumer stopped): parts fetched ahead are let go.
        for task in ahead:
            if task.done() and not task.cancelled() and task.exception() is None:
                LEDGER.sub(DOWNLOAD, len(task.result()))
            else:
                task.cancel()
        await asyncio.gather(*ahead, return_exceptions=True)


class Pieces:
    """Element-aligned pieces of a payload's tensors, from its chunks in order."""

    def __init__(self, key: str, size: int, expect: Sequence[TensorSpec] | None) -> None:
        self.key = key
        self.size = size
        self.expect = expect
        self.entries: list[Entry] | None = None  # known once the header is read
        self._head = b""  # the stream's first bytes, until the header is complete
        self._pos = 0  # stream offset of the next chunk

    def feed(self, chunk: bytes) -> list[tuple[str, int, torch.Tensor]]:
        """The pieces ``chunk`` completes (the header is validated first)."""
        start = self._pos
        self._pos += len(chunk)
        if self.entries is None:
            # The header comes first; it is almost always whole in the first chunk (then
            # read in place, not copied).
            self._head = chunk if not self._head else self._head + bytes(chunk)
            if not self._header():
                self._head = bytes(self._head)
                return []
            chunk, start = self._head, 0
            self._head = b""
        assert self.entries is not None
        pieces: list[tuple[str, int, torch.Tensor]] = []
        stop = start + len(chunk)
        for entry in self.entries:
            lo, hi = max(entry.begin, start), min(entry.end, stop)
            if lo >= hi:
                continue
            at = lo - start  # in the chunk
            done = lo - entry.begin  # bytes of the tensor before this piece
            if entry.carry:  # the element the previous chunk cut: complete it
                take = min(entry.itemsize - len(entry.carry), hi - lo)
                entry.carry += bytes(memoryview(chunk)[at : at + take])
                at, done = at + take, done + take
                if len(entry.carry) < entry.itemsize:
                    continue
                element = torch.frombuffer(bytearray(entry.carry), dtype=entry.dtype)
                entry.carry = b""
                pieces.append((entry.name, done // entry.itemsize - 1, element))
            usable = hi - start - at
            whole = usable - usable % entry.itemsize
            if whole:
                view = view_of(chunk, entry.dtype, whole // entry.itemsize, at)
                pieces.append((entry.name, done // entry.itemsize, view))
            if usable > whole:
                entry.carry = bytes(memoryview(chunk)[at + whole : at + usable])
        return pieces

    def _header(self) -> bool:
        head = self._head
        if len(head) < 8:
            return False
        (length,) = struct.unpack_from("<Q", head, 0)
        if length > min(MAX_HEADER, self.size - 8):
            raise ProtocolError(f"{self.key}: the safetensors header claims {length} bytes")
        if len(head) < 8 + length:
            return False
        try:
            header = json.loads(head[8 : 8 + length])
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"{self.key}: the safetensors header is not JSON ({exc})") from exc
        self.entries = entries(self.key, header, 8 + length, self.size, self.expect)
        return True

    def finish(self) -> None:
        """Check that the stream ended where its size said and held a whole header."""
        if self.entries is None:
            raise ProtocolError(f"{self.key}: {self._pos} bytes cannot hold a safetensors header")
        if self._pos != self.size:
            raise PayloadCorrupt(f"{self.key}: {self._pos} bytes read, {self.size} expected")


async def stream_tensors(
    box: Mailbox,
    key: str,
    expect: Sequence[TensorSpec] | None,
    prepare: Callable[[list[Entry]], Sink],
    *,
    stop: threading.Event | None = None,
    window: int = WINDOW,
) -> list[Entry]:
    """Feed every piece of the payload ``key``, in stream order, to the sink ``prepare``
    returns when called with the validated entries (once the header is read, before any
    data); sinks run on a worker thread, a chunk at a time. Returns the entries."""
    pieces: Pieces | None = None
    target: Sink | None = None
    loop = asyncio.get_running_loop()
    # aclosing: a failure in here stops the fetches ahead at once, not at collection.
    async with contextlib.aclosing(chunks(box, key, window=window, stop=stop)) as stream:
        async for size, chunk in stream:
            if pieces is None:
                pieces = Pieces(key, size, expect)
            found = pieces.feed(chunk)
            if target is None and pieces.entries is not None:
                target = prepare(pieces.entries)
            if found:
                assert target is not None
                await loop.run_in_executor(workers(), _deliver, target, found)
    assert pieces is not None
    pieces.finish()
    assert pieces.entries is not None
    return pieces.entries


def fixed(sink: Sink) -> Callable[[list[Entry]], Sink]:
    """For :func:`stream_tensors`: the same ``sink`` whatever the entries."""
    return lambda _: sink


def _deliver(sink: Sink, found: list[tuple[str, int, torch.Tensor]]) -> None:
    with torch.no_grad():
        for name, first, piece in found:
            sink(name, first, piece)


_pool: ThreadPoolExecutor | None = None


def _forget_pool() -> None:
    global _pool
    _pool = None


# A forked child inherits the pool object but none of its threads: the pool, counting its
# workers as alive, would never start new ones, and every transfer in the child would wait
# for ever on a queue nobody serves (seen: learners forked from a process that had synced
# before hung at their first round). The child starts a pool of its own instead.
os.register_at_fork(after_in_child=_forget_pool)


def workers() -> ThreadPoolExecutor:
    """The payload worker threads (hashing, joining, copying): a few, shared by every
    transfer of the process, so the allocator's per-thread arenas stay few too."""
    global _pool
    if _pool is None:
        count = max(2, min(4, os.cpu_count() or 2))
        _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="gm-hash")
    return _pool


async def read_into(
    box: Mailbox,
    key: str,
    expect: Sequence[TensorSpec] | None,
    into: Mapping[str, torch.Tensor],
    *,
    stop: threading.Event | None = None,
) -> dict[str, torch.Tensor]:
    """Copy the payload ``key`` into ``into`` (contiguous tensors of its names, dtypes and
    shapes), part by part; returns ``into``. On a failure ``into`` holds a partial copy."""
    flat = {name: tensor.view(-1) for name, tensor in into.items()}
    for name, tensor in into.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{key}: into[{name!r}] must be contiguous")

    def copy(name: str, first: int, piece: torch.Tensor) -> None:
        flat[name][first : first + piece.numel()].copy_(piece)

    sink = _checked(key, into, copy)
    found = await stream_tensors(box, key, expect, fixed(sink), stop=stop)
    missing = set(into) - {entry.name for entry in found}
    if missing:
        raise ValueError(f"{key}: the payload lacks {sorted(missing)[:3]}")
    return dict(into)


def _checked(key: str, into: Mapping[str, torch.Tensor], sink: Sink) -> Sink:
    """``sink``, refusing pieces of tensors ``into`` lacks or holds in another dtype."""

    def checked(name: str, first: int, piece: torch.Tensor) -> None:
        target = into.get(name)
        if target is None:
            raise ValueError(f"{key}: into= lacks {name!r}")
        if target.dtype != piece.dtype or first + piece.numel() > target.numel():
            raise ValueError(f"{key}: into[{name!r}] is {target.dtype}{list(target.shape)}")
        sink(name, first, piece)

    return checked


async def read_new(
    box: Mailbox,
    key: str,
    expect: Sequence[TensorSpec] | None,
    purpose: str = DOWNLOAD,
    *,
    stop: threading.Event | None = None,
) -> dict[str, torch.Tensor]:
    """The payload ``key`` streamed into fresh tensors carved from one buffer (charged to
    ``purpose`` in the ledger while it lives)."""
    out: dict[str, torch.Tensor] = {}

    def prepare(found: list[Entry]) -> Sink:
        out.update(_allocate(found, purpose))
        flat = {name: tensor.view(-1) for name, tensor in out.items()}

        def copy(name: str, first: int, piece: torch.Tensor) -> None:
            flat[name][first : first + piece.numel()].copy_(piece)

        return copy

    await stream_tensors(box, key, expect, prepare, stop=stop)
    return out


def _allocate(found: Sequence[Entry], purpose: str) -> dict[str, torch.Tensor]:
    sizes = [entry.end - entry.begin for entry in found]
    flat = torch.empty(sum(-(-n // 64) * 64 for n in sizes), dtype=torch.uint8)
    if flat.numel():
        LEDGER.track(purpose, flat.untyped_storage(), flat.numel())
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for entry, nbytes in zip(found, sizes, strict=True):
        view = flat[offset : offset + nbytes].view(dtype=entry.dtype).view(size=entry.shape)
        out[entry.name] = view
        offset += -(-nbytes // 64) * 64
    return out
