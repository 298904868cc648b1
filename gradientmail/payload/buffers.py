"""Fragment-sized buffers, reused once released: snapshots, the closer's new parameters and
momentum, downloaded commits.

A fresh fragment-sized tensor is mapped and page-faulted in on first touch: on the machines
benchmarked here, filling fresh memory runs at about a fifth of memcpy, which is most of a
combine's time. A buffer cannot simply be kept and rewritten: what a closer computes goes
to the training thread (staged, applied, then kept as the reference and the next round's
base) and to payload encoding, which hold references the pool never sees.

So a buffer is reused only when nothing but the pool references its storage: every set of
tensors the pool hands out is carved, as views, from one flat byte buffer (so a set of any
fragment fits any buffer large enough: fragments are balanced), and the pool compares the
storage's use count with the count it had when only the pool held it. Any view, slice,
numpy array or detached alias still alive raises that count, so a buffer still read
anywhere is never written. Without torch's storage use counter (a private function),
nothing is reused.

Memory: busy buffers cost nothing extra (they are alive anyway); of the released ones the
pool keeps at most ``idle`` for reuse and lets the rest go. A learner's steady state is
thus its live buffers plus ``idle`` fragments, whatever the number of fragments. Buffers
grow to the largest set asked for, so that, after one round of every fragment, any buffer
serves any fragment. Every buffer is charged to the pool's purpose in the process's ledger
(``gradientmail.ledger``) from its allocation until it is freed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from gradientmail.ledger import LEDGER, PURPOSES

__all__ = ["BufferPool"]

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)
_ALIGN = 64  # bytes: every tensor carved from a buffer starts on a cache line


def _count(tensor: torch.Tensor) -> int:
    assert _use_count is not None
    return _use_count(tensor.untyped_storage()._cdata)


def _layout(
    like: Mapping[str, torch.Tensor], dtype: torch.dtype | None
) -> tuple[list[tuple[str, torch.Size, torch.dtype, int]], int]:
    """Where each tensor of the set starts in a flat buffer, and the bytes it needs."""
    entries = []
    offset = 0
    for name, value in like.items():
        kind = dtype or value.dtype
        entries.append((name, value.shape, kind, offset))
        nbytes = value.numel() * torch.empty(0, dtype=kind).element_size()
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, offset


def _carve(
    flat: torch.Tensor, entries: list[tuple[str, torch.Size, torch.dtype, int]]
) -> dict[str, torch.Tensor]:
    views = {}
    for name, shape, dtype, offset in entries:
        count = shape.numel()
        size = count * torch.empty(0, dtype=dtype).element_size()
        views[name] = flat[offset : offset + size].view(dtype=dtype).view(size=shape)
    return views


class _Buffer:
    def __init__(self, nbytes: int, device: torch.device, purpose: str) -> None:
        self.flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self.idle_count = _count(self.flat) if _use_count is not None else 0
        if device.type == "cpu":  # the ledger counts host memory
            LEDGER.track(purpose, self.flat.untyped_storage(), nbytes)

    def released(self) -> bool:
        return _count(self.flat) == self.idle_count


class BufferPool:
    """Sets of buffers carved from flat buffers, reused once released; at most ``idle``
    released buffers are kept. Thread-safe (a closer and a syncer share one)."""

    def __init__(self, purpose: str, idle: int = 1) -> None:
        if purpose not in PURPOSES:
            raise ValueError(f"unknown memory purpose {purpose!r} (one of {PURPOSES})")
        if idle < 0:
            raise ValueError(f"idle must be >= 0, not {idle}")
        self.purpose = purpose
        self.idle = idle
        self._buffers: list[_Buffer] = []
        self._largest = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0
        LEDGER.watch_pool(self)

    def take(
        self, like: Mapping[str, torch.Tensor], dtype: torch.dtype | None = torch.float32
    ) -> dict[str, torch.Tensor]:
        """Tensors shaped as ``like`` (of ``dtype``; None: ``like``'s), contiguous, on
        ``like``'s device (one device per set): views into a released buffer large enough,
        else into a fresh one. Their contents are undefined."""
        devices = {value.device for value in like.values()}
        if len(devices) > 1:
            raise ValueError(f"a pooled set lives on one device, not {sorted(map(str, devices))}")
        device = devices.pop() if devices else torch.device("cpu")
        entries, needed = _layout(like, dtype)
        with self._lock:
            chosen = None
            if _use_count is not None:
                self._trim()
                fitting = [
                    b
                    for b in self._buffers
                    if b.flat.device == device and b.nbytes >= needed and b.released()
                ]
                if fitting:
                    chosen = min(fitting, key=lambda b: b.nbytes)
                    self.reused += 1
            if chosen is None:
                self._largest = max(self._largest, needed)
                chosen = _Buffer(max(self._largest, 1), device, self.purpose)
                self.allocated += 1
                if _use_count is not None:
                    self._buffers.append(chosen)
            return _carve(chosen.flat, entries)

    def _trim(self) -> None:
        """Let go of released buffers beyond ``idle`` (and of any smaller than the largest
        set asked for: they would fit fewer sets)."""
        keep: list[_Buffer] = []
        idle = 0
        for buffer in sorted(self._buffers, key=lambda b: -b.nbytes):
            if buffer.released():
                if idle >= self.idle or buffer.nbytes < self._largest:
                    continue
                idle += 1
            keep.append(buffer)
        self._buffers = keep

    def trim(self) -> None:
        """Let go now of the released buffers beyond ``idle`` (also done by :meth:`take`)."""
        if _use_count is None:
            return
        with self._lock:
            self._trim()

    def idle_bytes(self) -> int:
        """Bytes of released buffers this pool keeps for reuse now."""
        if _use_count is None:
            return 0
        with self._lock:
            return sum(b.nbytes for b in self._buffers if b.released())
