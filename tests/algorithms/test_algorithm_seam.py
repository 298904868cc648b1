"""The Algorithm seam: the round engine runs any algorithm that keeps the protocol.

A plain sample-weighted average with no state of its own (what Moshpit's group commits
and the compressed algorithms will be, in shape) runs through Session, the closer,
verify and align without the engine knowing DiLoCo.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms.base import Tensors, register
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.payload import get_tensors
from tests.training import Learner, commits, run_learners, verify_all


@register
@dataclass(frozen=True)
class PlainAverage:
    """Sample-weighted average of the contributions; keeps no state (an empty payload)."""

    sync_every: int = 5
    fragments: int = 1

    @property
    def name(self) -> str:
        return "plainaverage"

    def settings(self) -> dict[str, Any]:
        return {"name": self.name, "sync_every": self.sync_every, "fragments": self.fragments}

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> PlainAverage:
        return cls(sync_every=settings["sync_every"], fragments=settings["fragments"])

    def offset(self, fragment: int) -> int:
        return DiLoCo(sync_every=self.sync_every, fragments=self.fragments).offset(fragment)

    def split(self, names_and_sizes: Sequence[tuple[str, int]]) -> list[list[str]]:
        return DiLoCo(sync_every=self.sync_every, fragments=self.fragments).split(names_and_sizes)

    def state_specs(self, specs: Sequence[p.TensorSpec]) -> tuple[p.TensorSpec, ...]:
        return ()

    def weights(
        self, contributions: Sequence[tuple[str, int]], closer: str | None, /
    ) -> tuple[list[float], list[float]]:
        total = float(sum(samples for _, samples in contributions))
        shares = [samples / total for _, samples in contributions]
        return shares, shares

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
        return {name: mean[name].to(value.dtype) for name, value in base.items()}, {}


def test_a_custom_algorithm_is_an_algorithm() -> None:
    assert isinstance(PlainAverage(), gm.Algorithm)
    assert not isinstance(object(), gm.Algorithm)


def test_the_engine_runs_a_custom_algorithm_end_to_end() -> None:
    algorithm = PlainAverage(sync_every=5)
    box = gm.MemoryMailbox()
    learners = [Learner("a", 30, seed=1), Learner("b", 30, seed=2)]
    run_learners(learners, box, algorithm)  # type: ignore[arg-type]
    found = commits(box)
    assert len(found) > 2
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))
    assert manifest.algorithm["name"] == "plainaverage"
    # Every commit recomputes (verify reads the algorithm from the manifest).
    verified = verify_all(box)
    assert len(verified) == len(found)
    # A commit is the plain average of what it combined: its state payload is empty.
    newest = found[-1]
    assert newest.momentum is not None
    state = asyncio.run(get_tensors(box, newest.momentum, ()))
    assert state == {}
    aligned = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    gm.align(aligned, mailbox=box)


def test_an_unknown_algorithm_in_a_manifest_is_a_clear_error() -> None:
    from gradientmail.algorithms import from_manifest

    with pytest.raises(gm.ProtocolError, match="'gossip' is unknown"):
        from_manifest({"name": "gossip", "sync_every": 3})


def test_a_session_refuses_what_is_not_an_algorithm() -> None:
    with pytest.raises(TypeError, match=r"gm\.Algorithm"):
        gm.Session(torch.nn.Linear(2, 2), algorithm=object(), mailbox=gm.MemoryMailbox())  # type: ignore[arg-type]
