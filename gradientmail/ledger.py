"""The library's own accounting of the host memory it holds, by purpose.

Every large buffer GradientMail makes is charged to one purpose while it lives, so a
memory measurement can say who owns each byte (``bench/memory.py`` compares the total
with the process's peak RSS; the remainder is the allocator's and the training's):

- ``global``: commit parameters kept by a learner: the reference each fragment's next
  contribution is measured against, a commit staged for the training thread, the new
  parameters a closer computes;
- ``snapshots``: the copies of a fragment ``step()`` hands to the communication thread;
- ``momentum``: the algorithm's state at a closer (DiLoCo's outer momentum), downloaded
  or cached;
- ``encode``: payload parts joined for upload and not yet written;
- ``download``: payload parts received and not yet decoded;
- ``combine``: temporaries of a combine (float32 conversions of non-float32 pieces).

Pooled buffers stay charged to their purpose while the pool keeps them for reuse;
:func:`memory_usage` reports those bytes again under ``idle`` (a part of the others, not
added to the total).

No torch here: tensors are tracked through their storage (any object that takes a weak
reference), released when the last view of it is.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

__all__ = [
    "COMBINE",
    "DOWNLOAD",
    "ENCODE",
    "GLOBAL",
    "IDLE",
    "LEDGER",
    "MOMENTUM",
    "PURPOSES",
    "SNAPSHOTS",
    "Ledger",
    "MemoryUsage",
    "memory_usage",
]

GLOBAL = "global"
SNAPSHOTS = "snapshots"
MOMENTUM = "momentum"
ENCODE = "encode"
DOWNLOAD = "download"
COMBINE = "combine"
PURPOSES = (GLOBAL, SNAPSHOTS, MOMENTUM, ENCODE, DOWNLOAD, COMBINE)
IDLE = "idle"  # reported beside the purposes: pooled bytes kept for reuse (already counted)


class _Pool(Protocol):
    def idle_bytes(self) -> int: ...


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes held now (``live``) and at most since the last reset (``peak``), by purpose;
    ``peak_total``: the most held at once, all purposes together (not the sum of the
    per-purpose peaks, which need not coincide); ``idle``: pooled bytes kept for reuse
    now, already counted in ``live``."""

    live: Mapping[str, int] = field(default_factory=dict)
    peak: Mapping[str, int] = field(default_factory=dict)
    live_total: int = 0
    peak_total: int = 0
    idle: int = 0


class Ledger:
    """Thread-safe counters of bytes held, by purpose, with their peaks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live = dict.fromkeys(PURPOSES, 0)
        self._peak = dict.fromkeys(PURPOSES, 0)
        self._total = 0
        self._peak_total = 0
        self._pools: list[weakref.ref[_Pool]] = []
        # Frees reported by finalizers (track()): a finalizer runs when the garbage
        # collector does, which may be inside one of this class's own `with self._lock`
        # blocks on the same thread; taking the (non-reentrant) lock there would deadlock
        # the thread for ever. So a finalizer only appends here (atomic, lock-free), and
        # every locked section applies what is queued.
        self._freed: deque[tuple[str, int]] = deque()

    def add(self, purpose: str, nbytes: int) -> None:
        if purpose not in self._live:
            raise ValueError(f"unknown memory purpose {purpose!r} (one of {PURPOSES})")
        with self._lock:
            self._apply_freed()
            self._charge(purpose, nbytes)

    def _charge(self, purpose: str, nbytes: int) -> None:
        live = self._live[purpose] = self._live[purpose] + nbytes
        self._peak[purpose] = max(self._peak[purpose], live)
        self._total += nbytes
        self._peak_total = max(self._peak_total, self._total)

    def _apply_freed(self) -> None:
        """Apply the frees finalizers queued (under the lock)."""
        while self._freed:
            purpose, nbytes = self._freed.popleft()
            self._charge(purpose, -nbytes)

    def sub(self, purpose: str, nbytes: int) -> None:
        self.add(purpose, -nbytes)

    @contextmanager
    def holding(self, purpose: str, nbytes: int) -> Iterator[None]:
        """Charge ``nbytes`` to ``purpose`` for the ``with`` block."""
        self.add(purpose, nbytes)
        try:
            yield
        finally:
            self.sub(purpose, nbytes)

    def track(self, purpose: str, owner: object, nbytes: int) -> None:
        """Charge ``nbytes`` to ``purpose`` until ``owner`` (a tensor's storage) is freed."""
        self.add(purpose, nbytes)
        weakref.finalize(owner, self._freed.append, (purpose, nbytes))

    def watch_pool(self, pool: _Pool) -> None:
        """Report ``pool.idle_bytes()`` under ``idle`` while the pool lives."""
        with self._lock:
            self._pools = [ref for ref in self._pools if ref() is not None]
            self._pools.append(weakref.ref(pool))

    def usage(self, *, reset: bool = False) -> MemoryUsage:
        """The counters now; ``reset``: the peaks start again from what is held now."""
        with self._lock:
            pools = [pool for ref in self._pools if (pool := ref()) is not None]
        idle = sum(pool.idle_bytes() for pool in pools)
        with self._lock:
            self._apply_freed()
            usage = MemoryUsage(
                live=MappingProxyType(dict(self._live)),
                peak=MappingProxyType(dict(self._peak)),
                live_total=self._total,
                peak_total=self._peak_total,
                idle=idle,
            )
            if reset:
                self._peak = dict(self._live)
                self._peak_total = self._total
        return usage


LEDGER = Ledger()
"""The process's ledger: every Session, closer and payload transfer charges it."""


def memory_usage(*, reset: bool = False) -> MemoryUsage:
    """What GradientMail holds in host memory now and at its peak, by purpose (see
    :mod:`gradientmail.ledger`); ``reset=True`` restarts the peaks from now."""
    return LEDGER.usage(reset=reset)
