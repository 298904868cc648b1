"""A model seen as fragments: which parameters each fragment holds, and copies in and out."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gradientmail._buffers import BufferPool
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.protocol import Manifest, TensorSpec

__all__ = ["ModelLayout"]


class ModelLayout:
    def __init__(self, model: torch.nn.Module, algorithm: DiLoCo) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        named = list(model.named_parameters())
        if not named:
            raise ValueError("the model has no parameters to train")
        self.params: dict[str, torch.nn.Parameter] = dict(named)
        groups = algorithm.split([(name, p.numel()) for name, p in named])
        self.fragments: tuple[tuple[str, ...], ...] = tuple(tuple(g) for g in groups)
        self.specs: tuple[tuple[TensorSpec, ...], ...] = tuple(
            tuple(
                TensorSpec(name, tuple(self.params[name].shape), str(self.params[name].dtype))
                for name in group
            )
            for group in self.fragments
        )

    def manifest(self, creator: str, algorithm: DiLoCo) -> Manifest:
        return Manifest(creator=creator, algorithm=algorithm.settings(), fragments=self.specs)

    @property
    def count(self) -> int:
        return len(self.fragments)

    def nbytes(self, fragment: int) -> int:
        return sum(
            self.params[n].numel() * self.params[n].element_size() for n in self.fragments[fragment]
        )

    def copy_out(self, fragment: int, pool: BufferPool | None = None) -> dict[str, torch.Tensor]:
        """A detached copy of the fragment's parameters (safe to keep while training goes on),
        into buffers from ``pool`` when given (a released copy's memory, not fresh pages)."""
        with torch.no_grad():
            names = self.fragments[fragment]
            if pool is None:
                return {n: self.params[n].detach().clone() for n in names}
            source = {n: self.params[n].detach() for n in names}
            copies = pool.take(fragment, source, dtype=None)
            for name, value in source.items():
                copies[name].copy_(value)
            return copies

    def load(self, fragment: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the fragment's parameters in place (the optimizer keeps its references)."""
        with torch.no_grad():
            for name in self.fragments[fragment]:
                self.params[name].copy_(tensors[name])

    def rebase(
        self,
        fragment: int,
        new_global: Mapping[str, torch.Tensor],
        anchor: Mapping[str, torch.Tensor],
    ) -> None:
        """``param ← new_global + (param − anchor)``: adopt a commit, keep local progress.

        ``anchor`` is what the commit already accounts for: the snapshot this learner
        contributed, or the previous global if it did not contribute.
        """
        with torch.no_grad():
            for name in self.fragments[fragment]:
                param = self.params[name]
                # In place, no temporaries: a fresh buffer per tensor costs more than the math.
                param.add_(new_global[name]).sub_(anchor[name])
