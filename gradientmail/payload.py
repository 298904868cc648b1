"""Tensors ↔ mailbox bytes: the safetensors format, named by the bytes' sha256.

No pickle ever crosses the mailbox: a safetensors file is a JSON header plus raw
little-endian buffers, so bytes read from a shared bucket cannot run code. A payload's key is
``blobs/{sha256 of its bytes}``; reading verifies the hash (:class:`PayloadCorrupt` on a
mismatch) and the layout the reader expects (:class:`ProtocolError`). Writing the same
tensors twice writes one object.

The codec is our own, for speed, and writes standard safetensors (``safetensors.torch.load``
reads it; we read what ``safetensors.torch.save`` writes):

- encoding is one copy: ``b"".join`` of the header and each tensor's memory;
- decoding copies nothing: each tensor is a read-only view into the received bytes
  (``torch.frombuffer``), which callers only read (combine) or copy into the model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
import sys
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.protocol import TensorSpec, blob_key, blob_sha

__all__ = ["decode", "encode", "get_tensors", "put_tensors"]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("gradientmail's payload codec assumes a little-endian machine")

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024

# The views decode() returns are over immutable bytes; nothing writes through them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def encode(tensors: Mapping[str, torch.Tensor]) -> tuple[str, bytes]:
    """Serialise ``tensors`` (sorted by name); return ``(blobs/<sha256>, bytes)``."""
    header: dict[str, object] = {}
    chunks: list[memoryview] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} cannot be sent")
        flat = tensor.cpu().contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        view = raw.numpy().data.cast("B")
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(view)],
        }
        chunks.append(view)
        offset += len(view)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    pieces: list[bytes | memoryview] = [struct.pack("<Q", len(text)), text, *chunks]
    digest = hashlib.sha256()
    if offset < _OVERLAP_BYTES:
        data = b"".join(pieces)
        digest.update(data)
    else:
        # Hash the source buffers on a helper thread while this one copies them into the
        # payload: hashlib releases the GIL, so the two overlap (and training keeps going).
        def hash_pieces() -> None:
            for piece in pieces:
                digest.update(piece)

        hashing = _hasher().submit(hash_pieces)
        data = b"".join(pieces)
        hashing.result()
    return blob_key(digest.hexdigest()), data


_OVERLAP_BYTES = 4 * 1024 * 1024
_executor: ThreadPoolExecutor | None = None


def _hasher() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gm-hash")
    return _executor


def _layout(key: str, data: bytes) -> tuple[int, dict[str, Any]]:
    if len(data) < 8:
        raise ProtocolError(f"{key}: {len(data)} bytes cannot hold a safetensors header")
    (size,) = struct.unpack_from("<Q", data)
    if size > min(_MAX_HEADER, len(data) - 8):
        raise ProtocolError(f"{key}: the safetensors header claims {size} bytes")
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{key}: the safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ProtocolError(f"{key}: the safetensors header is not an object")
    header.pop("__metadata__", None)
    return 8 + size, header


def decode(
    key: str, data: bytes, expect: Sequence[TensorSpec] | None = None
) -> dict[str, torch.Tensor]:
    """Verify ``data`` against the hash in ``key`` (and the expected layout); return
    read-only tensor views into ``data``."""
    sha = blob_sha(key)
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha:
        raise PayloadCorrupt(
            f"{key}: the {len(data)} bytes read hash to {actual[:16]}…; the object is "
            "corrupt or truncated"
        )
    start, header = _layout(key, data)
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        try:
            dtype = _BY_NAME[str(info["dtype"])]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"{key}: bad safetensors entry for {name!r} ({exc!r})") from exc
        count = 1
        for n in shape:
            count *= n
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if begin < 0 or end - begin != count * itemsize or start + end > len(data):
            raise ProtocolError(f"{key}: {name!r} has inconsistent offsets or shape")
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(
                data, dtype=dtype, count=count, offset=start + begin
            ).reshape(shape)
    if expect is not None:
        wanted = {spec.name: spec for spec in expect}
        if set(tensors) != set(wanted):
            missing = sorted(set(wanted) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(wanted))[:3]
            raise ProtocolError(
                f"{key}: tensors differ from the manifest (missing {missing}, unexpected {extra})"
            )
        for name, tensor in tensors.items():
            spec = wanted[name]
            if tuple(tensor.shape) != spec.shape or str(tensor.dtype) != spec.dtype:
                raise ProtocolError(
                    f"{key}: {name} is {tensor.dtype}{list(tensor.shape)}, the manifest "
                    f"says {spec.dtype}{list(spec.shape)}"
                )
    return tensors


async def put_tensors(box: Mailbox, tensors: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """Store ``tensors`` as a blob; return its key and size. Idempotent.

    Encoding runs in a worker thread: the calling loop keeps serving (beats, polls), and two
    payloads (a commit's parameters and momentum) encode side by side.
    """
    key, data = await asyncio.to_thread(encode, tensors)
    await box.put_if_absent(key, data)  # False: the same bytes are already there
    return key, len(data)


async def get_tensors(
    box: Mailbox, key: str, expect: Sequence[TensorSpec] | None = None
) -> dict[str, torch.Tensor]:
    data = await box.get(key)
    if data is None:
        raise ProtocolError(
            f"{key}: the payload is missing (swept, or written to a different store)"
        )
    if len(data) < _OVERLAP_BYTES:
        return decode(key, data, expect)
    return await asyncio.to_thread(decode, key, data, expect)  # hashing releases the GIL
