"""Tensors ↔ mailbox bytes: the safetensors format, named by the bytes' sha256.

No pickle ever crosses the mailbox: a safetensors file is a JSON header plus raw
little-endian buffers, so bytes read from a shared bucket cannot run code. A payload's key is
``blobs/{sha256 of its bytes}``; reading verifies the hash (:class:`PayloadCorrupt` on a
mismatch) and the layout the reader expects (:class:`ProtocolError`). Writing the same
tensors twice writes one object.

A payload larger than :data:`PART_BYTES` (16 MiB) is stored in parts: consecutive byte ranges of the
same safetensors stream, each a blob named by its own sha256, plus a small JSON index
(``blobs/{sha256 of the index}.parts``) naming them in order; records name the index. Parts
are hashed on several cores and transferred concurrently, in both directions (one sha256
over one stream runs on one core, ~1.8 GB/s here), and no single object outgrows what one
S3 ``PutObject`` takes (5 GB).

The codec is our own, for speed, and writes standard safetensors (``safetensors.torch.load``
reads it, or the concatenated parts; we read what ``safetensors.torch.save`` writes):

- encoding is one copy: ``b"".join`` of the header and each tensor's memory (per part);
- decoding copies nothing: each tensor is a read-only view into the received bytes
  (``torch.frombuffer``), which callers only read (combine) or copy into the model; only a
  tensor that straddles two parts is joined into fresh memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradientmail.errors import ObjectMissing, PayloadCorrupt, ProtocolError
from gradientmail.ledger import DOWNLOAD, ENCODE, LEDGER
from gradientmail.mailbox import Mailbox
from gradientmail.payload._format import MAX_HEADER, NAMES, entries, memory_of, view_of
from gradientmail.payload.stream import read_new
from gradientmail.payload.stream import workers as _workers
from gradientmail.wire import TensorSpec, blob_key, is_parts_key, parts_key
from gradientmail.wire.parts import (
    MAX_PARTS,
    PARTS_FORMAT,
    IndexWire,
    PartWire,
    blob_keys,
    parse_index,
    verify_blob,
)

__all__ = [
    "PART_BYTES",
    "Encoded",
    "blob_keys",
    "can_send",
    "decode",
    "encode",
    "encode_payload",
    "get_tensors",
    "payload_key",
    "put_tensors",
    "stored_key",
]

PART_BYTES = 16 * 1024 * 1024
"""Payloads above this many bytes are stored as parts of this size (the last one shorter).
Part of the key scheme: the same tensors give the same keys only under the same value.
16 MiB, not more: glibc serves allocations above its dynamic mmap threshold (at most
32 MiB) with fresh mappings, page-faulted in on every use; below it, a freed part's memory
is reused. Measured here (400 MB, filesystem): 0.55 GB/s end to end with 32 MiB parts,
0.96 GB/s with 16 MiB."""
_TRANSFERS = 4  # part transfers in flight per payload

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("gradientmail's payload codec assumes a little-endian machine")

_DTYPES = NAMES


def can_send(dtype: torch.dtype) -> bool:
    """Whether a payload can carry tensors of ``dtype``."""
    return dtype in _DTYPES


def _stream(tensors: Mapping[str, torch.Tensor]) -> tuple[list[memoryview], int]:
    """The safetensors stream of ``tensors`` (sorted by name) as buffers, not yet copied:
    the 8-byte header length, the header, then each tensor's memory."""
    header: dict[str, object] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")
        flat = tensor.cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        view = memory_of(raw)
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(view)],
        }
        chunks.append(view)
        offset += len(view)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    pieces = [memoryview(struct.pack("<Q", len(text))), memoryview(text), *chunks]
    return pieces, 8 + len(text) + offset


def _join_hashing(pieces: Sequence[memoryview], size: int) -> tuple[str, bytes]:
    """One blob: the pieces joined, named by their sha256."""
    digest = hashlib.sha256()
    if size < _OVERLAP_BYTES:
        data = b"".join(pieces)
        digest.update(data)
    else:
        # Hash the source buffers on a helper thread while this one copies them into the
        # payload: hashlib releases the GIL, so the two overlap (and training keeps going).
        def hash_pieces() -> None:
            for piece in pieces:
                digest.update(piece)

        hashing = _workers().submit(hash_pieces)
        data = b"".join(pieces)
        hashing.result()
    return blob_key(digest.hexdigest()), data


def _join_then_hash(pieces: Sequence[memoryview]) -> tuple[str, bytes]:
    data = b"".join(pieces)
    return blob_key(hashlib.sha256(data).hexdigest()), data


def _cut(pieces: Sequence[memoryview], part_bytes: int) -> list[list[memoryview]]:
    """Split the stream into consecutive ranges of ``part_bytes`` (views, no copies)."""
    groups: list[list[memoryview]] = [[]]
    room = part_bytes
    for piece in pieces:
        while len(piece):
            if room == 0:
                groups.append([])
                room = part_bytes
            take = piece[:room]
            groups[-1].append(take)
            room -= len(take)
            piece = piece[len(take) :]
    return groups


@dataclass(frozen=True)
class Encoded:
    """A payload ready to store: ``objects`` in the order to write them (parts before the
    index that names them); ``key`` is what records name, ``size`` the stream's bytes."""

    key: str
    size: int
    objects: tuple[tuple[str, bytes], ...]


def encode(tensors: Mapping[str, torch.Tensor]) -> tuple[str, bytes]:
    """Serialise ``tensors`` (sorted by name) as one blob; return ``(blobs/<sha256>, bytes)``."""
    pieces, size = _stream(tensors)
    return _join_hashing(pieces, size)


def encode_payload(tensors: Mapping[str, torch.Tensor], part_bytes: int | None = None) -> Encoded:
    """Serialise ``tensors`` as stored: one blob up to ``part_bytes`` (default
    :data:`PART_BYTES`), else parts (joined and hashed side by side on worker threads) and
    their index."""
    pieces, size = _stream(tensors)
    groups = _groups(pieces, size, part_bytes)
    if len(groups) == 1:
        key, data = _join_hashing(pieces, size)
        return Encoded(key, size, ((key, data),))
    pool = _workers()
    parts = [future.result() for future in [pool.submit(_join_then_hash, g) for g in groups]]
    key, index = _index(size, parts)
    return Encoded(key, size, (*parts, (key, index)))


def payload_key(tensors: Mapping[str, torch.Tensor], part_bytes: int | None = None) -> str:
    """The key :func:`encode_payload` gives ``tensors``, by hashing their memory in place
    (no copy of the payload is made)."""
    pieces, size = _stream(tensors)
    groups = _groups(pieces, size, part_bytes)

    def digest(group: Sequence[memoryview]) -> str:
        hashed = hashlib.sha256()
        for piece in group:
            hashed.update(piece)
        return hashed.hexdigest()

    if len(groups) == 1:
        return blob_key(digest(pieces))
    parts = [(blob_key(digest(g)), sum(len(piece) for piece in g)) for g in groups]
    return _index(size, parts)[0]


async def stored_key(box: Mailbox, tensors: Mapping[str, torch.Tensor], stored: str) -> str:
    """The key ``tensors`` get when stored the way ``stored`` was: one blob, or parts of the
    size its index shows (the writer's part size, whatever this process's is). Compare it
    with ``stored`` to check that ``tensors`` are what a record names."""
    part_bytes = sys.maxsize  # one blob, whatever its size
    if is_parts_key(stored):
        data = await box.get(stored)
        if data is None:
            raise ObjectMissing(f"{stored}: the payload is missing (swept, or another store)")
        part_bytes = parse_index(stored, data)[0]["size"]
    return await asyncio.to_thread(payload_key, tensors, part_bytes)


def _groups(pieces: list[memoryview], size: int, part_bytes: int | None) -> list[list[memoryview]]:
    """The stream's parts: all of it when it fits ``part_bytes``."""
    if part_bytes is None:
        part_bytes = PART_BYTES
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be positive, not {part_bytes}")
    if size <= part_bytes:
        return [pieces]
    if -(-size // part_bytes) > MAX_PARTS:
        raise ValueError(f"{size} bytes in parts of {part_bytes} would take over {MAX_PARTS}")
    return _cut(pieces, part_bytes)


def _index(size: int, parts: Sequence[tuple[str, bytes] | tuple[str, int]]) -> tuple[str, bytes]:
    wire: IndexWire = {
        "format": PARTS_FORMAT,
        "size": size,
        "parts": [
            {"key": key, "size": data if isinstance(data, int) else len(data)}
            for key, data in parts
        ],
    }
    index = json.dumps(wire, separators=(",", ":")).encode()
    return parts_key(hashlib.sha256(index).hexdigest()), index


_OVERLAP_BYTES = 4 * 1024 * 1024


class _Stream:
    """A payload's bytes, held as one or more consecutive chunks (its parts)."""

    def __init__(self, chunks: Sequence[bytes]) -> None:
        self.chunks = chunks
        self.starts: list[int] = []
        total = 0
        for chunk in chunks:
            self.starts.append(total)
            total += len(chunk)
        self.size = total

    def view(self, begin: int, end: int) -> tuple[bytes, int]:
        """``(buffer, offset)`` holding bytes ``begin:end``: a chunk itself when the range
        lies inside one (no copy), else the range joined into fresh memory."""
        for i, start in enumerate(self.starts):
            chunk = self.chunks[i]
            if start <= begin and end <= start + len(chunk):
                return chunk, begin - start
        return b"".join(memoryview(c)[at : at + n] for c, at, n, _ in self.pieces(begin, end)), 0

    def pieces(self, begin: int, end: int) -> list[tuple[bytes, int, int, int]]:
        """The chunks bytes ``begin:end`` lie in: ``(chunk, offset, length, position in the
        range)`` each."""
        found = []
        for i, start in enumerate(self.starts):
            chunk = self.chunks[i]
            lo, hi = max(begin, start), min(end, start + len(chunk))
            if lo < hi:
                found.append((chunk, lo - start, hi - lo, lo - begin))
        return found

    def copy_into(self, begin: int, end: int, target: torch.Tensor) -> None:
        """Copy bytes ``begin:end`` into the contiguous ``target`` (torch copies release the
        GIL; no intermediate buffer)."""
        raw = target.view(-1).view(torch.uint8)
        for chunk, at, n, pos in self.pieces(begin, end):
            raw[pos : pos + n].copy_(view_of(chunk, torch.uint8, n, at))


def _layout(key: str, stream: _Stream) -> tuple[int, Any]:
    if stream.size < 8:
        raise ProtocolError(f"{key}: {stream.size} bytes cannot hold a safetensors header")
    buffer, at = stream.view(0, 8)
    (size,) = struct.unpack_from("<Q", buffer, at)
    if size > min(MAX_HEADER, stream.size - 8):
        raise ProtocolError(f"{key}: the safetensors header claims {size} bytes")
    buffer, at = stream.view(8, 8 + size)
    try:
        header = json.loads(bytes(memoryview(buffer)[at : at + size]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{key}: the safetensors header is not JSON ({exc})") from exc
    return 8 + size, header


def decode(
    key: str, data: bytes, expect: Sequence[TensorSpec] | None = None
) -> dict[str, torch.Tensor]:
    """Verify ``data`` (one blob) against the hash in ``key`` (and the expected layout);
    return read-only tensor views into ``data``."""
    verify_blob(key, data)
    return _tensors(key, _Stream([data]), expect)


def _tensors(
    key: str,
    stream: _Stream,
    expect: Sequence[TensorSpec] | None,
    into: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors in ``stream``: views into its chunks (a tensor that straddles two is copied
    into fresh memory), or, with ``into``, copied into those tensors. Everything is
    validated before anything is created or written."""
    start, header = _layout(key, stream)
    found = entries(key, header, start, stream.size, expect)
    layout = {e.name: (e.dtype, e.shape, e.count, e.begin, e.end) for e in found}
    if into is not None:
        if set(into) != set(layout):
            raise ValueError(
                f"{key}: into= holds {sorted(into)[:3]}…, the payload {sorted(layout)[:3]}…"
            )
        for name, (dtype, shape, *_) in layout.items():
            target = into[name]
            if target.dtype != dtype or list(target.shape) != shape:
                raise ValueError(
                    f"{key}: into[{name!r}] is {target.dtype}{list(target.shape)}, the payload "
                    f"holds {dtype}{shape}"
                )
            if not target.is_contiguous() or target.device.type != "cpu":
                raise ValueError(f"{key}: into[{name!r}] must be a contiguous CPU tensor")
        with torch.no_grad():
            for name, (_, _, count, begin, end) in layout.items():
                if count:
                    stream.copy_into(begin, end, into[name])
        return dict(into)
    tensors: dict[str, torch.Tensor] = {}
    for name, (dtype, shape, count, begin, end) in layout.items():
        if count == 0:
            tensors[name] = torch.empty(size=shape, dtype=dtype)
            continue
        pieces = stream.pieces(begin, end)
        if len(pieces) == 1:
            chunk, at, _, _ = pieces[0]
            view = view_of(chunk, dtype, count, at)
            tensors[name] = view.reshape(shape=shape)
        else:  # straddles parts: into fresh memory, by torch copies (no GIL held)
            tensors[name] = torch.empty(size=shape, dtype=dtype)
            stream.copy_into(begin, end, tensors[name])
    return tensors


async def put_tensors(
    box: Mailbox,
    tensors: Mapping[str, torch.Tensor],
    *,
    limit: asyncio.Semaphore | None = None,
) -> tuple[str, int]:
    """Store ``tensors`` as a blob (or parts and their index); return the key records name
    and the payload's size. Idempotent.

    Encoding runs in worker threads: the calling loop keeps serving (beats, polls), and two
    payloads (a commit's parameters and momentum) encode side by side. A payload in parts
    is a stream: at most :data:`_TRANSFERS` parts are joined or being written at once, so
    encoding holds a few parts, never a copy of the whole payload (charged to ``encode``
    in the ledger while held). ``limit``: a semaphore shared by puts that run side by
    side, so that together they hold no more parts than it allows.
    """
    pieces, size = await asyncio.to_thread(_stream, tensors)  # .contiguous() may copy
    groups = _groups(pieces, size, None)
    loop = asyncio.get_running_loop()
    if limit is None:
        limit = asyncio.Semaphore(_TRANSFERS)
    if len(groups) == 1:
        async with limit:
            # A thread of its own, not a payload worker: _join_hashing hands the hashing to
            # the workers and waits for it, and two such waits (a commit's parameters and
            # momentum) on a pool of two would leave nobody to hash.
            key, data = await asyncio.to_thread(_join_hashing, pieces, size)
            with LEDGER.holding(ENCODE, len(data)):
                await box.put_if_absent(key, data)  # False: the same bytes are already there
        return key, size
    # Each part is stored as soon as a worker has joined and hashed it: the writes of the
    # first parts overlap the encoding of the later ones. The semaphore is taken before the
    # join, so no more than _TRANSFERS parts exist at once.

    async def part(group: list[memoryview]) -> tuple[str, int]:
        async with limit:
            part_key, data = await loop.run_in_executor(_workers(), _join_then_hash, group)
            with LEDGER.holding(ENCODE, len(data)):
                await box.put_if_absent(part_key, data)
            return part_key, len(data)

    parts = await asyncio.gather(*(part(g) for g in groups))
    # The index last: whoever can read it (a record names it only after this returns, but a
    # sweeper lists blobs/ at any time) finds every part it names already stored.
    key, index = _index(size, parts)
    await box.put_if_absent(key, index)
    return key, size


async def get_tensors(
    box: Mailbox,
    key: str,
    expect: Sequence[TensorSpec] | None = None,
    *,
    into: Mapping[str, torch.Tensor] | None = None,
    purpose: str = DOWNLOAD,
) -> dict[str, torch.Tensor]:
    """Read, verify and decode the payload ``key`` names (a blob, or a part index and its
    parts, fetched concurrently and verified on worker threads).

    A blob decodes to read-only views into its bytes. A payload in parts is streamed into
    fresh tensors (one contiguous buffer, charged to ``purpose`` in the ledger while it
    lives): a few parts are held at a time, never the payload and a copy of it.

    With ``into`` (contiguous CPU tensors of the payload's names, dtypes and shapes: a
    model's parameters, a reused buffer), the bytes are copied into those instead, once
    every part is verified, and they are returned. Nothing is written into ``into`` when
    anything fails (so every part is held until then).
    """
    if into is None and is_parts_key(key):
        return await read_new(box, key, expect, purpose)
    data = await _get(box, key)
    if not is_parts_key(key):
        if len(data) < _OVERLAP_BYTES:
            verify_blob(key, data)
            return _tensors(key, _Stream([data]), expect, into)
        return await asyncio.to_thread(_verified_tensors, key, data, expect, into)
    parts = parse_index(key, data)
    limit = asyncio.Semaphore(_TRANSFERS)

    async def fetch(part: PartWire) -> bytes:
        async with limit:
            blob = await _get(box, part["key"], of=key)
        if len(blob) != part["size"]:
            raise PayloadCorrupt(
                f"{key}: part {part['key']} holds {len(blob)} bytes, the index says {part['size']}"
            )
        await asyncio.to_thread(verify_blob, part["key"], blob)
        return blob

    chunks = await asyncio.gather(*(fetch(part) for part in parts))
    # A thread: everything is copied into ``into`` here.
    return await asyncio.to_thread(_tensors, key, _Stream(chunks), expect, into)


def _verified_tensors(
    key: str,
    data: bytes,
    expect: Sequence[TensorSpec] | None,
    into: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    verify_blob(key, data)  # hashing releases the GIL: a thread, not the loop
    return _tensors(key, _Stream([data]), expect, into)


async def _get(box: Mailbox, key: str, of: str | None = None) -> bytes:
    data = await box.get(key)
    if data is None:
        what = f"{of}: its part {key}" if of else key
        raise ObjectMissing(
            f"{what}: the payload is missing (swept, or written to a different store)"
        )
    return data
