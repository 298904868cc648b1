"""Moshpit SGD: small averaging groups on a virtual grid, no closer that sees everyone.

Learners train locally and, every ``sync_every`` steps, average their parameters with a
small group instead of with the whole run. The groups come from a virtual grid of
``grid_dims`` dimensions of side ``group_size`` (``M``): a learner's grid index is a
``grid_dims``-tuple of coordinates in ``0 .. M-1``, and in group round ``t`` (``t >= 1``)
the active dimension is ``(t - 1) % grid_dims``. Learners whose coordinates agree on every
other dimension meet: a group is a line of the grid along the active dimension, named by
those other coordinates (:func:`group_key`), so every learner finds its group from its own
index, without a view of who else is in the run.

After a round each member's coordinate along the active dimension becomes its chunk index
in the group (the paper's ``r_i``), one no other member holds (:func:`next_index`): two
learners that met then differ in that coordinate, and the next round, whose key includes
it, puts them in different groups. On a full grid (``M ** grid_dims``
learners, one per cell) ``grid_dims`` consecutive rounds average every learner with every
other: with equal weights each then holds the exact global mean.

A learner's first index is the cell of its *slot*, a number it claims create-once when it
joins (``grid/{slot}``, the smallest free one; a restarted learner finds its own again):
slot ``s`` sits at the coordinates of ``s`` in base ``M``, dimension 0 least significant
(:func:`initial_index`). Slots are dense, so a run of ``N < M ** grid_dims`` learners fills
a prefix of the grid and every line is a prefix of its coordinates; a closer can tell how
many members its group should have from the slots alone (``engine/groups.py``). Slots past
``M ** grid_dims`` wrap around and share cells: groups then grow past ``M``.

A group round is the engine's weighted sum (:meth:`Moshpit.weights`: ``samples_i / Σ
samples``, members in learner-id order, float32) and :meth:`Moshpit.finish`, which returns
that average as the new parameters: no outer step, no state kept with a commit. Any process
recomputes a group commit from its record bit for bit (``gradientmail verify``).

Compression is not supported: a compressed contribution is a pseudo-gradient against a
base every contributor shares, and a group's members hold different parameters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch

from gradientmail.algorithms.base import register
from gradientmail.settings import MAX_GRID_DIMS, MAX_GROUP_SIZE, algorithm_info, check
from gradientmail.wire import TensorSpec

__all__ = [
    "MAX_GRID_DIMS",
    "MAX_GROUP_SIZE",
    "Moshpit",
    "active_dim",
    "group_key",
    "in_group",
    "initial_index",
    "next_index",
]

_ACTIVE = "x"  # the active dimension's place in a group key


def active_dim(t: int, grid_dims: int) -> int:
    """The dimension group round ``t`` (``t >= 1``) averages along."""
    if t < 1:
        raise ValueError(f"group rounds start at 1, not {t}")
    return (t - 1) % grid_dims


def initial_index(slot: int, group_size: int, grid_dims: int) -> tuple[int, ...]:
    """The grid cell of ``slot``: its digits in base ``group_size``, dimension 0 least
    significant (slots past ``group_size ** grid_dims`` wrap around)."""
    if slot < 0:
        raise ValueError(f"a slot is a number >= 0, not {slot}")
    return tuple((slot // group_size**dim) % group_size for dim in range(grid_dims))


def group_key(index: Sequence[int], t: int) -> str:
    """The group a learner at ``index`` joins in round ``t``: its other coordinates, three
    digits each, the active dimension written ``x`` (``"003-x-001"``; ``"x"`` for one
    dimension, where every learner meets every other)."""
    dim = active_dim(t, len(index))
    return "-".join(_ACTIVE if i == dim else f"{c:03d}" for i, c in enumerate(index))


def in_group(index: Sequence[int], t: int, key: str) -> bool:
    """Whether a learner at ``index`` belongs to group ``key`` of round ``t``."""
    return group_key(index, t) == key


def next_index(
    index: Sequence[int],
    t: int,
    members: Sequence[tuple[str, Sequence[int]]],
    me: str,
    group_size: int,
) -> tuple[int, ...]:
    """This learner's index after group round ``t`` with ``members`` (``(learner, index)``
    of each, this learner among them): its coordinate along the active dimension becomes
    its chunk index in the group, a coordinate no other member holds. A member whose
    coordinate is its own alone keeps it (with dense slots that is everyone, so the grid
    stays as the slots laid it out and closers can tell who to expect); members sharing a
    coordinate (slots that wrapped around) take the free ones in order of learner id, so
    they are apart the next round."""
    dim = active_dim(t, len(index))
    counts = Counter(m[1][dim] for m in members)
    mine = index[dim]
    if counts[mine] <= 1 or all(learner != me for learner, _ in members):
        return tuple(index)
    held = {c for c, n in counts.items() if n == 1}
    free = [c for c in range(group_size) if c not in held]
    sharing = sorted(((m[1][dim], m[0]) for m in members if counts[m[1][dim]] > 1), key=lambda x: x)
    rank = [learner for _, learner in sharing].index(me)
    new = list(index)
    new[dim] = free[rank % len(free)] if free else mine
    return tuple(new)


@register
@dataclass(frozen=True)
class Moshpit:
    """``gm.Moshpit(sync_every=…, group_size=M, grid_dims=d)``: every ``sync_every`` local
    steps a learner averages its parameters with its group (a line of an ``M ** d`` grid;
    see the module docstring). Pick ``M ** d`` close to the number of learners, at least as
    large: a full grid holds the exact global average after ``d`` rounds."""

    sync_every: int = 100
    group_size: int = 4
    grid_dims: int = 2

    def __post_init__(self) -> None:
        check(type(self).__name__, algorithm_info(self.name).fields, self)

    @property
    def name(self) -> str:
        return "moshpit"

    @property
    def fragments(self) -> int:
        """One: a group averages whole models (no streaming fragments)."""
        return 1

    @property
    def grid_cells(self) -> int:
        return int(self.group_size**self.grid_dims)

    def settings(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sync_every": self.sync_every,
            "group_size": self.group_size,
            "grid_dims": self.grid_dims,
        }

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Self:
        values = {k: v for k, v in settings.items() if k != "name"}
        unknown = sorted(set(values) - set(algorithm_info("moshpit").names))
        if unknown:
            raise ValueError(f"Moshpit settings {unknown} are unknown to this release")
        return cls(**values)

    # -- schedule ----------------------------------------------------------------------------

    def offset(self, fragment: int) -> int:
        return 0

    def split(self, names_and_sizes: Sequence[tuple[str, int]]) -> list[list[str]]:
        return [[name for name, _ in names_and_sizes]]

    # -- the group round ---------------------------------------------------------------------

    def state_specs(self, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        return ()

    def weights(
        self, contributions: Sequence[tuple[str, int]], closer: str | None, /
    ) -> tuple[list[float], list[float]]:
        """Parameters and buffers alike: ``samples_i / Σ samples``."""
        total = float(sum(samples for _, samples in contributions))
        weights = [samples / total for _, samples in contributions]
        return weights, weights

    def finish(
        self,
        base: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None,
        mean: dict[str, torch.Tensor],
        /,
        *,
        state_out: dict[str, torch.Tensor] | None = None,
        buffer_names: Collection[str] = (),
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The group's weighted average itself, in the parameters' dtypes (``base`` gives
        only the dtypes: a group has no shared previous commit)."""
        return {name: mean[name].to(dtype=base[name].dtype) for name in base}, {}
