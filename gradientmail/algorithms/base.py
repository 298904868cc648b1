"""The seam between the round engine and an algorithm: :class:`Algorithm`.

The engine (``engine/``, ``session/``) knows rounds, fragments, snapshots and commits; an
algorithm says when a fragment is due, how a model splits into fragments, and how a
round's contributions become the next commit, together with the state it keeps with that
commit (DiLoCo's outer momentum; another algorithm's error-feedback or nothing). The
state travels as a payload of its own named by the commit record (the ``momentum`` wire
field, kept for compatibility), so any node can close any round and a late joiner gets
all of it.

Requirements every implementation keeps:

- a round is two steps: the engine sums the contributions, each weighted as
  :meth:`Algorithm.weights` says, in learner-id order, in float32 (streamed part by part
  from the mailbox at a closer, so its memory does not grow with the number of
  contributors); then :meth:`Algorithm.finish` turns those sums and the previous commit
  into the next one. Both are deterministic and element-wise, so any process recomputes a
  commit bit for bit (``engine/verify.py``), however the tensors were cut into pieces on
  the way (``gradientmail.testing.reference.combine`` is the whole-tensor form of the same
  two steps, the reference the tests and benchmarks compare with);
- ``settings()`` is JSON and round-trips through ``from_settings``; the manifest records
  it, and a joiner whose settings differ gets a ``ProtocolError`` listing the difference.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, Self, runtime_checkable

import torch

from gradientmail.ledger import COMBINE, LEDGER
from gradientmail.wire import TensorSpec

__all__ = ["Algorithm", "Contribution", "Tensors", "accumulate"]

Tensors = dict[str, torch.Tensor]
# (learner id, samples since its last contribution, its fragment's tensors)
Contribution = tuple[str, int, Mapping[str, torch.Tensor]]


@runtime_checkable
class Algorithm(Protocol):
    """What the round engine needs of an algorithm (see the module docstring)."""

    @property
    def name(self) -> str:
        """The manifest's ``algorithm.name``: which class reads these settings."""
        ...

    @property
    def sync_every(self) -> int:
        """Local steps between two contributions of the same fragment."""
        ...

    @property
    def fragments(self) -> int:
        """How many fragments the model is split into (rounds cycle through them)."""
        ...

    def settings(self) -> dict[str, Any]:
        """What the manifest records; every node must agree on all of it."""
        ...

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Self:
        """The algorithm a manifest's settings describe."""
        ...

    def offset(self, fragment: int) -> int:
        """The local step (mod ``sync_every``) at which ``fragment`` is due."""
        ...

    def split(self, names_and_sizes: Sequence[tuple[str, int]]) -> list[list[str]]:
        """Parameter names (in model order) grouped into ``fragments`` groups."""
        ...

    def state_specs(self, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        """The tensors of the state kept with a commit of a fragment laid out as ``specs``
        (DiLoCo: one momentum tensor per tensor; a stateless algorithm: none)."""
        ...

    def weights(
        self, contributions: Sequence[tuple[str, int]], closer: str | None, /
    ) -> tuple[Sequence[float], Sequence[float]]:
        """How much each contribution counts, given ``(learner, samples)`` in learner-id
        order and the closing learner: ``(for parameters, for floating-point buffers)``,
        one weight per contribution each. The engine sums ``weight · local`` per tensor in
        float32, in this order; a zero weight skips the contribution for that kind."""
        ...

    def finish(
        self,
        base: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None,
        mean: Tensors,
        /,
        *,
        state_out: Tensors | None = None,
        buffer_names: Collection[str] = (),
    ) -> tuple[Tensors, Tensors]:
        """The next commit's tensors and the state kept with it, from the previous commit's
        (``base``, ``state``: None before the first round) and ``mean``, the contributions'
        weighted sums (float32, contiguous; ``finish`` may overwrite them and return them).
        ``state_out``: buffers for the new state, when given (they may be ``state``'s own,
        for an element-wise update)."""
        ...


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` readable from a manifest (by its ``name``). A class the settings
    registry does not list validates its own settings, and its rounds are exchanged
    run-wide (``settings.exchange_kind``); the registry itself, what the CLI, the run spec
    and the CRD offer, is not changed by it."""
    ALGORITHMS[cls.__name__.lower()] = cls
    return cls


def from_manifest(settings: Mapping[str, Any]) -> Algorithm:
    """The algorithm a manifest's ``algorithm`` settings name (``ProtocolError`` naming an
    unknown one: a newer release wrote the run)."""
    from gradientmail.errors import ProtocolError

    name = settings.get("name", "diloco")
    cls = ALGORITHMS.get(str(name))
    if cls is None:
        raise ProtocolError(
            f"the run's algorithm {name!r} is unknown to this release (known: "
            f"{sorted(ALGORITHMS)}); upgrade gradientmail"
        )
    return cls.from_settings(settings)


def accumulate(acc: torch.Tensor, piece: torch.Tensor, weight: float, first: int = 0) -> None:
    """``acc[first : first + n] += weight · piece`` over the flattened float32 ``acc``: one
    piece of one contribution's tensor. Element-wise, so summing a tensor in pieces gives
    the same bits as summing it whole (``tests/payload/test_memory.py`` checks it)."""
    if weight == 0.0:
        return
    target = acc.view(-1)[first : first + piece.numel()]
    if piece.dtype == torch.float32:
        target.add_(piece.reshape(-1), alpha=weight)
        return
    with LEDGER.holding(COMBINE, piece.numel() * 4):  # the float32 conversion of the piece
        target.add_(piece.reshape(-1).to(dtype=torch.float32), alpha=weight)
