"""The safetensors layout, shared by the whole-payload codec (``transfer.py``) and the
streamed reader (``stream.py``): dtype names, the header's size limit, and the validation
of a header's entries (offsets, shapes, and the layout a reader expects); and the two ways
between tensors and raw memory both use, with torch alone (no numpy): :func:`memory_of` (a
tensor's bytes as a buffer) and :func:`view_of` (a tensor over received bytes)."""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from gradientmail.errors import ProtocolError
from gradientmail.wire import TensorSpec

__all__ = ["BY_NAME", "MAX_HEADER", "NAMES", "Entry", "entries", "memory_of", "view_of"]

MAX_HEADER = 100 * 1024 * 1024
"""The largest safetensors header a reader accepts, in bytes."""

_EMPTY = memoryview(b"")


def memory_of(raw: torch.Tensor) -> memoryview:
    """The memory of ``raw`` (a contiguous uint8 CPU tensor) as a read-only buffer, without a
    copy and without numpy: a ctypes array over the tensor's data that holds a reference to
    the tensor, so the storage lives (and its use count, which buffer pools read, stays
    raised) as long as the buffer does."""
    if raw.dtype != torch.uint8 or raw.device.type != "cpu" or not raw.is_contiguous():
        raise ValueError(f"memory_of needs a contiguous uint8 CPU tensor, not {raw.dtype}")
    if raw.numel() == 0:
        return _EMPTY
    array = (ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())
    array._gradientmail_owner = raw  # type: ignore[attr-defined]
    return memoryview(array).cast("B").toreadonly()


# torch.frombuffer warns about every read-only buffer (bytes); the views made here are over
# immutable payload bytes that nothing writes through, so the warning is silenced for these
# calls only, never process-wide. The lock keeps the library's own catch_warnings blocks
# from interleaving (each saves and restores the process's filter list).
_QUIET = threading.Lock()


def view_of(buffer: Any, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """``count`` elements of ``dtype`` at ``offset`` of ``buffer``, as a tensor sharing its
    memory (``torch.frombuffer``), without the read-only buffer warning."""
    with _QUIET, warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given buffer is not writable", category=UserWarning
        )
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)


BY_NAME: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Entry:
    """One tensor of a payload: where its bytes lie in the stream (absolute offsets)."""

    __slots__ = ("begin", "carry", "count", "dtype", "end", "itemsize", "name", "shape")

    def __init__(
        self, name: str, dtype: torch.dtype, shape: list[int], begin: int, end: int
    ) -> None:
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.begin = begin  # absolute byte offsets in the stream
        self.end = end
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        self.count = (end - begin) // self.itemsize if self.itemsize else 0
        self.carry = b""  # the bytes of an element cut by a chunk boundary


def entries(
    key: str, header: Any, start: int, size: int, expect: Sequence[TensorSpec] | None
) -> list[Entry]:
    """The header's tensors, validated (offsets, shapes, and ``expect`` when given)."""
    if not isinstance(header, dict):
        raise ProtocolError(f"{key}: the safetensors header is not an object")
    header.pop("__metadata__", None)
    found: list[Entry] = []
    for name, info in header.items():
        try:
            dtype = BY_NAME[str(info["dtype"])]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"{key}: bad safetensors entry for {name!r} ({exc!r})") from exc
        count = 1
        for n in shape:
            if n < 0:
                raise ProtocolError(f"{key}: {name!r} has a negative dimension")
            count *= n
        entry = Entry(name, dtype, shape, start + begin, start + end)
        if begin < 0 or end - begin != count * entry.itemsize or start + end > size:
            raise ProtocolError(f"{key}: {name!r} has inconsistent offsets or shape")
        found.append(entry)
    if expect is not None:
        wanted = {spec.name: spec for spec in expect}
        names = {entry.name for entry in found}
        if names != set(wanted):
            missing = sorted(set(wanted) - names)[:3]
            extra = sorted(names - set(wanted))[:3]
            raise ProtocolError(
                f"{key}: tensors differ from the manifest (missing {missing}, unexpected {extra})"
            )
        for entry in found:
            spec = wanted[entry.name]
            if tuple(entry.shape) != spec.shape or str(entry.dtype) != spec.dtype:
                raise ProtocolError(
                    f"{key}: {entry.name} is {entry.dtype}{entry.shape}, the manifest says "
                    f"{spec.dtype}{list(spec.shape)}"
                )
    found.sort(key=lambda entry: entry.begin)
    return found


NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in BY_NAME.items()}
