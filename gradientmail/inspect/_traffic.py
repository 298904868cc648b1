"""The bytes of a run, for :mod:`gradientmail.inspect`: what the learners moved against
what dense float32 rounds would move (:class:`Traffic`), the dense size of one round from
the manifest (:func:`model_bytes`), and the compression settings in words
(:func:`describe_compression`). No torch: dtypes are sized from their names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradientmail.wire import Manifest

__all__ = ["Traffic", "describe_compression", "model_bytes", "model_dtypes"]


@dataclass(frozen=True)
class Traffic:
    """What the learners moved to and from the mailbox, in all (beats carry it), and
    ``dense``: the least dense float32 rounds would move for the same contributions (None
    for an uncompressed run, or before the manifest is there to size it)."""

    bytes_up: int
    bytes_down: int
    dense: int | None

    @property
    def moved(self) -> int:
        return self.bytes_up + self.bytes_down

    @property
    def ratio(self) -> float | None:
        """``dense / moved``: how many times fewer bytes than dense (None when unknown)."""
        return None if self.dense is None or not self.moved else self.dense / self.moved


# Bytes per element of the dtypes a manifest names (the inspector has no torch).
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}


def model_bytes(manifest: Manifest | None) -> int | None:
    """The dense bytes of one round of every fragment (None when a dtype is unknown)."""
    if manifest is None:
        return None
    total = 0
    for specs in manifest.fragments:
        for spec in specs:
            size = _ITEMSIZE.get(spec.dtype.removeprefix("torch."))
            if size is None:
                return None
            total += size * math.prod(spec.shape)
    return total


def model_dtypes(manifest: Manifest | None) -> tuple[str, ...]:
    """The dtypes of the tensors rounds carry (``("bfloat16", "float32")``), sorted; empty
    before the manifest exists."""
    if manifest is None:
        return ()
    names = {spec.dtype.removeprefix("torch.") for specs in manifest.fragments for spec in specs}
    return tuple(sorted(names))


def describe_compression(
    algorithm: Mapping[str, Any] | None, dtypes: Sequence[str] = ("float32",)
) -> str:
    """A manifest's compression settings in words: ``top-2% of 4096, 2-bit``,
    ``bfloat16``, ``int8``, or ``none (...)`` naming the model's ``dtypes`` (``none
    (float32)``, ``none (bfloat16, float32)``)."""
    settings = None if algorithm is None else algorithm.get("compression")
    if not isinstance(settings, Mapping):
        return f"none ({', '.join(dtypes)})" if dtypes else "none"
    name = settings.get("name")
    if name == "topk":
        density = 100 * float(settings.get("density", 0))
        return f"top-{density:.3g}% of {settings.get('chunk')}, {settings.get('bits')}-bit"
    if name == "cast":
        return str(settings.get("dtype"))
    if name == "quantize":
        return f"int{settings.get('bits')}"
    return str(name)
