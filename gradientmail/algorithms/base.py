"""The seam between the round engine and an algorithm: :class:`Algorithm`.

The engine (``engine/``, ``session/``) knows rounds, fragments, snapshots and commits; an
algorithm says when a fragment is due, how a model splits into fragments, and how a
round's contributions become the next commit, together with the state it keeps with that
commit (DiLoCo's outer momentum; another algorithm's error-feedback or nothing). The
state travels as a payload of its own named by the commit record (the ``momentum`` wire
field, kept for compatibility), so any node can close any round and a late joiner gets
all of it.

Requirements every implementation keeps:

- ``combine`` is deterministic given its inputs (contributions in learner-id order,
  float32 accumulation), so any process recomputes a commit bit for bit
  (``engine/verify.py``);
- ``settings()`` is JSON and round-trips through ``from_settings``; the manifest records
  it, and a joiner whose settings differ gets a ``ProtocolError`` listing the difference.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, Self, runtime_checkable

import torch

from gradientmail.wire import TensorSpec

__all__ = ["Algorithm", "Contribution", "Tensors"]

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

    def combine(
        self,
        base: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None,
        contributions: Sequence[Contribution],
        /,
        *,
        out: tuple[Tensors, Tensors] | None = None,
        buffer_names: Collection[str] = (),
        closer: str | None = None,
    ) -> tuple[Tensors, Tensors]:
        """The next commit's tensors and the state kept with it, from the previous
        commit's (``base``, ``state``: None before the first round) and the round's
        contributions; written into ``out`` when given."""
        ...


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Make ``cls`` readable from a manifest (by its ``name``)."""
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
