"""SparseLoCo: DiLoCo whose outer momentum is replaced by error feedback on sparse updates.

Each learner keeps an error-feedback accumulator per fragment and, at each of its sync
points, on its communication thread (``algorithms/contribution.py``):

    e ← error_decay · e + (global − local)       (its pseudo-gradient, accumulated)
    c = C(e)                                     (top-k per chunk, quantized: gm.TopK)
    e ← e − D(c)                                 (what was not sent waits for a later round)

A round sums the decoded contributions, sample-weighted in learner-id order (``Δ̄``), and
steps ``global' = global − outer_lr · Δ̄``. There is no state kept with a commit (no
momentum payload), so a learner that applied a fragment's previous commit computes the
next one from the round's compressed contributions alone: downloads are as small as
uploads (``session/_background.py``). Floating-point buffers travel dense and are
averaged (or the closer's), as with :class:`~gradientmail.algorithms.DiLoCo`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradientmail.algorithms.base import register
from gradientmail.algorithms.compression import Compression, TopK
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.settings import algorithm_info
from gradientmail.wire import TensorSpec

__all__ = ["SparseLoCo"]

_DEFAULT = TopK(density=0.02, bits=2)  # frozen: one instance serves every default


@register
@dataclass(frozen=True)
class SparseLoCo(DiLoCo):
    """``gm.SparseLoCo(sync_every=…)``: top-2% of each 4096-entry chunk, 2-bit values, error
    feedback decayed by ``error_decay`` between contributions, outer step ``outer_lr``."""

    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = False
    compression: Compression | None = _DEFAULT
    error_decay: float = 0.95
    dense_every: int = 1
    """A round's closer stores the commit's parameters at every ``dense_every``-th round
    of the fragment only (1: every round); the others' are computed by whoever needs them
    from the newest stored commit and the rounds' contributions (``engine/chain.py``)."""

    def __post_init__(self) -> None:
        super().__post_init__()  # the registry's fields (error_decay, dense_every, ...)
        name = type(self).__name__
        fixed = algorithm_info(self.name).fixed
        if any(getattr(self, key) != value for key, value in fixed.items()):
            raise ValueError(
                f"{name} has no outer momentum (error feedback replaces it): outer_momentum "
                f"must be 0 and nesterov False, not {self.outer_momentum!r} and {self.nesterov!r}"
            )
        if self.compression is None:
            raise ValueError(f"{name}(compression=None): SparseLoCo needs a compressor")

    @property
    def name(self) -> str:
        return "sparseloco"

    def settings(self) -> dict[str, Any]:
        settings = super().settings()
        settings["error_decay"] = self.error_decay
        if self.dense_every != 1:
            settings["dense_every"] = self.dense_every
        return settings

    def state_specs(self, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        """None: no state is kept with a commit."""
        return ()

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
        """``global − outer_lr · Δ̄`` in place in ``mean`` (buffers: their average, or the
        closer's copy); no state."""
        buffers = frozenset(buffer_names)
        params: dict[str, torch.Tensor] = {}
        for name, global_value in base.items():
            acc = mean[name]
            if name not in buffers:
                # fl(fl(−lr·Δ̄) + g): the same op order wherever a commit is computed.
                acc.mul_(-self.outer_lr).add_(global_value.to(dtype=torch.float32))
            params[name] = acc.to(dtype=global_value.dtype)
        return params, {}
