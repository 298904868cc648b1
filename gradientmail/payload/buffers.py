"""Fragment-sized buffers, reused once released: the closer's new parameters, the
snapshots step() copies out.

A fresh fragment-sized tensor is mapped and page-faulted in on first touch: on the machines
benchmarked here, filling fresh memory runs at about a fifth of memcpy, which is most of a
combine's time. The closer cannot simply keep last round's output: it goes to the training
thread (staged, applied, then kept as the reference and as the next round's base) and to
payload encoding, which hold references the closer never sees.

So a set is reused only when nothing but this pool references its storage: the pool hands
out *views* (new tensor objects over the same storage) and checks each storage's use count
against the count it had when only the pool held it. Any view, slice, numpy array or
detached alias still alive raises that count, so a buffer still read anywhere is never
written. Without torch's storage use counter (a private function), nothing is reused.

Memory: a pool keeps the sets it made alive (at most ``per_key`` per fragment) between the
moments they are used; the peak is what allocating per round reached anyway, but the
trough between rounds no longer drops to it. When every set is busy, a fresh one is made
and not kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["BufferPool"]

_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _count(tensor: torch.Tensor) -> int:
    assert _use_count is not None
    return _use_count(tensor.untyped_storage()._cdata)


class _Set:
    def __init__(self, like: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> None:
        self.tensors = {
            name: torch.empty(value.shape, dtype=dtype or value.dtype, device=value.device)
            for name, value in like.items()
        }
        self.idle = {name: _count(t) for name, t in self.tensors.items()}

    def fits(self, like: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> bool:
        return self.tensors.keys() == like.keys() and all(
            self.tensors[name].shape == value.shape
            and self.tensors[name].device == value.device
            and self.tensors[name].dtype == (dtype or value.dtype)
            for name, value in like.items()
        )

    def released(self) -> bool:
        return all(_count(t) == self.idle[name] for name, t in self.tensors.items())

    def views(self) -> dict[str, torch.Tensor]:
        return {name: t.view(t.shape) for name, t in self.tensors.items()}


class BufferPool:
    """Up to ``per_key`` sets of buffers per key (a fragment)."""

    def __init__(self, per_key: int = 3) -> None:
        self.per_key = per_key
        self._sets: dict[int, list[_Set]] = {}
        self.reused = 0
        self.allocated = 0

    def take(
        self,
        key: int,
        like: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = torch.float32,
    ) -> dict[str, torch.Tensor]:
        """Tensors shaped as ``like`` (of ``dtype``; None: ``like``'s): a released set's
        views, else fresh ones (kept for later reuse while the pool has room)."""
        if _use_count is None:
            self.allocated += 1
            return _Set(like, dtype).tensors
        sets = self._sets.setdefault(key, [])
        sets[:] = [s for s in sets if s.fits(like, dtype)]  # the layout never changes; be safe
        for candidate in sets:
            if candidate.released():
                self.reused += 1
                return candidate.views()
        self.allocated += 1
        fresh = _Set(like, dtype)
        if len(sets) < self.per_key:
            sets.append(fresh)
            return fresh.views()
        return fresh.tensors  # not pooled: nobody checks on it again
