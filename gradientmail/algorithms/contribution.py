"""Compressed contributions: a learner's pseudo-gradient with error feedback, as payload
tensors, and how a round adds them up.

An algorithm with a ``compression`` (``DiLoCo(compression=…)``, ``SparseLoCo``) has its
learners contribute, per fragment:

- each parameter ``p``: its pseudo-gradient accumulated into the learner's error feedback,
  ``e ← error_decay·e + (global − local)`` in float32, compressed (``c = C(e)``), stored
  as the tensors ``f"{p}#{suffix}"`` the compressor returns; the learner keeps
  ``e − D(c)`` (what was not sent goes with a later contribution);
- each floating-point buffer: its local value, dense, under its own name (statistics are
  averaged, not stepped).

A round's sums are then ``Σ wᵢ·D(cᵢ)`` per parameter, in learner-id order, in float32,
through the compressor's own ``add_decoded``: the closer, ``verify`` and a learner
applying a commit from its contributions all run this one function, so they get the same
bits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from gradientmail.algorithms.base import accumulate
from gradientmail.algorithms.compression import Compression
from gradientmail.errors import PayloadCorrupt
from gradientmail.wire import TensorSpec

__all__ = ["SEP", "Compressing", "add_contribution", "compression_of", "encode_contribution"]

SEP = "#"  # between a parameter's name and its compressed tensors' suffixes

Tensors = dict[str, torch.Tensor]


@runtime_checkable
class Compressing(Protocol):
    """An algorithm whose contributions may be compressed (its ``compression`` set)."""

    @property
    def compression(self) -> Compression | None: ...

    @property
    def error_decay(self) -> float: ...


def compression_of(algorithm: object) -> tuple[Compression, float] | None:
    """``(compressor, error_decay)`` when ``algorithm``'s contributions are compressed."""
    if not isinstance(algorithm, Compressing):
        return None
    compression = algorithm.compression
    return None if compression is None else (compression, float(algorithm.error_decay))


def encode_contribution(
    compression: Compression,
    error_decay: float,
    local: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor],
    residual: Mapping[str, torch.Tensor] | None,
    buffer_names: Collection[str],
) -> tuple[Tensors, Tensors]:
    """The payload tensors of one contribution and the learner's error feedback after it.

    ``local``: the learner's fragment at its sync point; ``base``: the commit it trained
    from; ``residual``: its error feedback before (None: zero). Runs on the communication
    thread. The new residual is fresh memory (float32, flat per parameter): ``residual``
    is left as it was, so a contribution that never makes it into a commit changes
    nothing (its steps go with the next one)."""
    payload: Tensors = {}
    new_residual: Tensors = {}
    buffers = frozenset(buffer_names)
    with torch.no_grad():
        for name, value in local.items():
            if name in buffers:
                payload[name] = value
                continue
            # e = decay·e_old + (g − l), in float32, flat
            acc = base[name].to(dtype=torch.float32, copy=True).view(size=(-1,))
            acc.sub_(value.reshape(shape=(-1,)).to(dtype=torch.float32))
            if residual is not None and name in residual:
                acc.add_(residual[name].view(size=(-1,)), alpha=error_decay)
            parts = compression.encode(acc)
            for suffix, tensor in parts.items():
                payload[f"{name}{SEP}{suffix}"] = tensor
            # e − D(c): exactly what the round adds for this learner at weight 1, subtracted
            compression.add_decoded(acc, parts, -1.0, where=f"{name} (own)")
            new_residual[name] = acc
    return payload, new_residual


def add_contribution(
    compression: Compression,
    flat: Mapping[str, torch.Tensor],
    payload: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    specs: Sequence[TensorSpec],
    buffer_names: Collection[str],
    *,
    where: str,
) -> None:
    """``flat[name] += weights[name] · D(contribution)`` for each tensor of ``specs``
    (``flat``: the sums, float32, flattened). The payload's names are checked first (a
    missing or unexpected tensor, a buffer of another dtype or shape: ``PayloadCorrupt``
    naming it, nothing added); a compressor's tensors are checked by it before it adds.
    ``where`` names the payload in errors."""
    buffers = frozenset(buffer_names)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    dense: dict[str, torch.Tensor] = {}
    for key, tensor in payload.items():
        name, sep, suffix = key.rpartition(SEP)
        if sep:
            grouped.setdefault(name, {})[suffix] = tensor
        else:
            dense[key] = tensor
    known = {spec.name for spec in specs}
    stray = sorted((set(grouped) | set(dense)) - known)
    if stray:
        raise PayloadCorrupt(f"{where}: tensors not in this fragment: {stray[:3]}")
    for spec in specs:
        if spec.name in buffers:
            value = dense.get(spec.name)
            if value is None:
                raise PayloadCorrupt(f"{where}: the buffer {spec.name!r} is missing")
            if str(value.dtype) != spec.dtype or list(value.shape) != list(spec.shape):
                raise PayloadCorrupt(
                    f"{where}: the buffer {spec.name!r} is {value.dtype}{list(value.shape)}, "
                    f"the run's {spec.dtype}{list(spec.shape)}"
                )
        else:
            if spec.name in dense:
                raise PayloadCorrupt(f"{where}: {spec.name!r} is dense, not compressed")
            if spec.name not in grouped:
                raise PayloadCorrupt(f"{where}: the parameter {spec.name!r} is missing")
    with torch.no_grad():
        for spec in specs:
            target = flat[spec.name]
            weight = weights[spec.name]
            if spec.name in buffers:
                accumulate(target, dense[spec.name], weight)
                continue
            if weight == 0.0:
                continue
            compression.add_decoded(
                target, grouped[spec.name], weight, where=f"{where}: {spec.name}"
            )
