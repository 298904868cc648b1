"""A round's weighted sums, streamed from the mailbox: the step the closer and ``verify``
share (the algorithm's ``finish`` follows).

Contributions are added in learner-id order, each weighted as ``Algorithm.weights`` says,
into float32 accumulators, one downloaded part at a time: memory holds the accumulators
and a window of parts, whatever the number of contributors. The additions are
element-wise, so the bits do not depend on where parts cut the tensors
(``testing.reference.combine`` adds whole tensors and gets the same).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gradientmail.algorithms.base import Algorithm, accumulate
from gradientmail.algorithms.contribution import add_contribution, compression_of
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors
from gradientmail.payload.stream import Sink, fixed, stream_tensors
from gradientmail.wire import TensorSpec

__all__ = ["Member", "Unusable", "weighted_sums"]


@dataclass(frozen=True)
class Member:
    """One contribution: its learner, samples, payload key, and, when the caller holds
    its tensors already (a closer's own snapshot: its payload's tensors when compressed),
    those."""

    learner: str
    samples: int
    payload: str
    local: Mapping[str, torch.Tensor] | None = None


class Unusable(Exception):
    """Member ``index``'s payload could not be read as this fragment's (missing, corrupt,
    other shapes); the accumulators hold part of it. ``cause``: the ProtocolError."""

    def __init__(self, index: int, cause: ProtocolError) -> None:
        super().__init__(f"contribution {index}: {cause}")
        self.index = index
        self.cause = cause


async def weighted_sums(
    box: Mailbox,
    algorithm: Algorithm,
    specs: Sequence[TensorSpec],
    buffer_names: frozenset[str],
    members: Sequence[Member],
    closer: str | None,
    out: Mapping[str, torch.Tensor],
) -> None:
    """Write the members' weighted sums into ``out`` (contiguous float32, one per tensor
    of ``specs``; zeroed first). ``members`` must be in learner-id order. Raises
    :class:`Unusable` naming the first member whose payload fails."""
    params_w, buffers_w = algorithm.weights([(m.learner, m.samples) for m in members], closer)
    await asyncio.to_thread(_zero, out)
    flat = {name: tensor.view(-1) for name, tensor in out.items()}
    compressed = compression_of(algorithm)
    for i, member in enumerate(members):
        weights = {name: buffers_w[i] if name in buffer_names else params_w[i] for name in out}
        if compressed is not None:
            # Compressed contributions are small: each is read whole, then decoded into
            # the sums (payload/ verifies its hash; the compressor its structure).
            try:
                payload = member.local
                if payload is None:
                    payload = await get_tensors(box, member.payload)
                await asyncio.to_thread(
                    add_contribution,
                    compressed[0],
                    flat,
                    payload,
                    weights,
                    specs,
                    buffer_names,
                    where=member.payload,
                )
            except ProtocolError as exc:
                raise Unusable(i, exc) from exc
            continue
        if member.local is not None:
            await asyncio.to_thread(_add_whole, flat, member.local, weights)
            continue
        try:
            await stream_tensors(box, member.payload, specs, fixed(_adder(flat, weights)))
        except ProtocolError as exc:
            raise Unusable(i, exc) from exc


def _zero(tensors: Mapping[str, torch.Tensor]) -> None:
    for tensor in tensors.values():
        tensor.zero_()


def _adder(flat: Mapping[str, torch.Tensor], weights: Mapping[str, float]) -> Sink:
    """A stream sink adding each piece, weighted, into the flattened sums."""

    def add(name: str, first: int, piece: torch.Tensor) -> None:
        accumulate(flat[name], piece, weights[name], first)

    return add


def _add_whole(
    flat: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
) -> None:
    with torch.no_grad():
        for name, acc in flat.items():
            accumulate(acc, local[name], weights[name])
