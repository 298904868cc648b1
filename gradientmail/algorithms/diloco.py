"""DiLoCo with streaming fragments.

Each node trains locally. The model's parameters are split into ``fragments`` contiguous
groups; fragment ``f`` is due every ``sync_every`` steps, the fragments staggered by
``sync_every / fragments`` steps (Streaming DiLoCo), so one fragment is in flight at a
time and peak bandwidth drops by ``fragments``.

A round of fragment ``f`` combines the contributions it received:

    delta    = Σ samples_i · (global − local_i) / Σ samples_i      (pseudo-gradient)
    momentum = outer_momentum · momentum + delta
    update   = delta + outer_momentum · momentum   (Nesterov)  or  momentum (plain)
    global'  = global − outer_lr · update

With ``outer_lr=1, outer_momentum=0`` this is the sample-weighted average of the local
parameters. ``combine`` is deterministic (contributions in learner-id order, float32
accumulation, element-wise ops only), so any process can recompute a commit from its
round record and the previous commit of its fragment and get the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DiLoCo"]


@dataclass(frozen=True)
class DiLoCo:
    sync_every: int = 100
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"DiLoCo(sync_every={self.sync_every!r}) must be an int >= 1")
        if not isinstance(self.fragments, int) or self.fragments < 1:
            raise ValueError(f"DiLoCo(fragments={self.fragments!r}) must be an int >= 1")
        if self.fragments > self.sync_every:
            raise ValueError(
                f"DiLoCo(fragments={self.fragments}) cannot exceed sync_every="
                f"{self.sync_every}: each fragment needs its own due step"
            )
        if not self.outer_lr > 0:
            raise ValueError(f"DiLoCo(outer_lr={self.outer_lr!r}) must be positive")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"DiLoCo(outer_momentum={self.outer_momentum!r}) must be in [0, 1)")

    @property
    def name(self) -> str:
        return "diloco"

    def settings(self) -> dict[str, Any]:
        """What the manifest records; every node must agree on all of it."""
        return {
            "name": self.name,
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
        }

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> DiLoCo:
        values = {k: v for k, v in settings.items() if k != "name"}
        return cls(**values)

    # -- schedule --------------------------------------------------------------------------

    def offset(self, fragment: int) -> int:
        """Local step (mod sync_every) at which ``fragment`` is due."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    def due_fragment(self, step: int) -> int | None:
        """The fragment due after local step ``step`` (1-based), if any."""
        phase = step % self.sync_every
        for fragment in range(self.fragments):
            if self.offset(fragment) == phase:
                return fragment
        return None

    def split(self, names_and_sizes: Sequence[tuple[str, int]]) -> list[list[str]]:
        """Split parameters (in model order) into ``fragments`` contiguous, balanced groups."""
        if len(names_and_sizes) < self.fragments:
            raise ValueError(
                f"the model has {len(names_and_sizes)} parameter tensors, fewer than "
                f"DiLoCo(fragments={self.fragments})"
            )
        total = sum(size for _, size in names_and_sizes)
        groups: list[list[str]] = [[] for _ in range(self.fragments)]
        filled = 0
        index = 0
        for position, (name, size) in enumerate(names_and_sizes):
            tensors_left = len(names_and_sizes) - position  # this one included
            groups_after = self.fragments - 1 - index
            # Move on once this group holds its share of the elements, or when the tensors
            # left are just enough to give every later group one.
            if (
                groups[index]
                and groups_after > 0
                and (filled >= total * (index + 1) / self.fragments or tensors_left == groups_after)
            ):
                index += 1
            groups[index].append(name)
            filled += size
        return groups

    # -- the round ---------------------------------------------------------------------------

    def combine(
        self,
        base: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor] | None,
        contributions: Sequence[tuple[str, int, Mapping[str, torch.Tensor]]],
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """New global parameters and momentum from ``(learner, samples, local)`` triples."""
        if not contributions:
            raise ValueError("a round needs at least one contribution")
        ordered = sorted(contributions, key=lambda c: c[0])
        total = float(sum(samples for _, samples, _ in ordered))
        new_params: dict[str, torch.Tensor] = {}
        new_momentum: dict[str, torch.Tensor] = {}
        lr, mu = self.outer_lr, self.outer_momentum
        for name, global_value in base.items():
            g = global_value.to(torch.float32)  # a view when already float32
            # No temporaries: the weighted average accumulates in the buffer that becomes the
            # new parameters, and the momentum buffer is the other output.
            out = torch.zeros_like(g)
            for _, samples, local in ordered:
                out.add_(local[name].to(torch.float32), alpha=samples / total)
            # delta = g − avg;  m = μ·m_old + delta
            if momentum is None:  # the first round: momentum starts at zero
                m = torch.sub(g, out)
            else:
                m = momentum[name].to(torch.float32).mul(mu).add_(g).sub_(out)
            if self.nesterov:
                # g − lr·(delta + μ·m)  =  (1 − lr)·g + lr·avg − lr·μ·m
                out.mul_(lr).add_(g, alpha=1 - lr).add_(m, alpha=-lr * mu)
            else:
                out.copy_(g).add_(m, alpha=-lr)  # g − lr·m
            new_params[name] = out.to(global_value.dtype)
            new_momentum[name] = m
        return new_params, new_momentum
