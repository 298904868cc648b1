"""The one read of a run's aligned model (``engine/align.py``): typed errors, listing again
when a live run's sweep took what was listed, and a layout made from the manifest alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.coord.sweep import newest_per_fragment
from gradientmail.engine.align import read_aligned
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ObjectMissing, ProtocolError, RoundMissing
from gradientmail.mailbox.memory import MemoryMailbox
from tests.training import Learner, commits, make_model, run_learners

ALGORITHM = gm.DiLoCo(sync_every=5, fragments=2)


class Sweeping(MemoryMailbox):
    """A store whose payloads read as missing until ``rounds/`` is listed ``hidden`` more
    times: what a reader sees when a live run sweeps what it just listed."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.listings = 0

    async def list(self, prefix: str, *, after: str = "") -> list[str]:
        if prefix == p.ROUNDS:
            self.listings += 1
        return await super().list(prefix, after=after)

    async def get(self, key: str) -> bytes | None:
        if key.startswith(p.BLOBS) and self.listings <= self.hidden:
            return None
        return await super().get(key)


def trained(box: gm.Mailbox) -> dict[int, int]:
    run_learners([Learner("alice", 10), Learner("bob", 10, seed=1)], box, ALGORITHM)
    return newest_per_fragment([p.round_key(c.round) for c in commits(box)], 2)


def manifest_of(box: gm.Mailbox) -> p.Manifest:
    return p.decode_manifest(p.MANIFEST, asyncio.run(box.get(p.MANIFEST)))


def test_the_typed_errors_are_protocol_errors() -> None:
    assert issubclass(ObjectMissing, ProtocolError)
    assert issubclass(RoundMissing, ProtocolError)


def test_a_record_that_reads_as_missing_is_object_missing() -> None:
    with pytest.raises(ObjectMissing, match="rounds/0000000003: the object is missing"):
        p.decode_commit(p.round_key(3), None)


def test_a_run_without_its_initial_commits_is_round_missing() -> None:
    box = MemoryMailbox()
    layout = ModelLayout(make_model(), ALGORITHM)
    manifest = layout.manifest("alice", ALGORITHM)
    asyncio.run(box.put_if_absent(p.MANIFEST, p.encode(manifest)))
    with pytest.raises(RoundMissing, match=r"fragments \[0, 1\] have no commit yet"):
        asyncio.run(read_aligned(box, manifest, layout))


def test_align_lists_again_when_the_sweep_took_what_it_listed() -> None:
    box = Sweeping(hidden=-1)
    newest = trained(box)
    box.hidden, box.listings = 1, 0  # the first listing's payloads are gone
    model = make_model(seed=7)
    assert gm.align(model, mailbox=box) == newest
    assert box.listings == 2
    reference = make_model(seed=8)
    assert gm.align(reference, mailbox=box) == newest
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_align_gives_up_after_three_listings_naming_what_is_gone() -> None:
    box = Sweeping(hidden=-1)
    trained(box)
    box.hidden, box.listings = 10, 0
    with pytest.raises(ObjectMissing, match="the payload is missing"):
        gm.align(make_model(seed=7), mailbox=box, timeout=30)
    assert box.listings == 3


def test_a_layout_from_the_manifest_reads_what_a_model_layout_reads() -> None:
    box = MemoryMailbox()
    newest = trained(box)
    manifest = manifest_of(box)
    model = make_model(seed=7)
    assert gm.align(model, mailbox=box) == newest
    layout = ModelLayout.from_manifest(manifest)
    assert layout.specs == ModelLayout.for_run(make_model(), manifest).specs
    loaded = asyncio.run(read_aligned(box, manifest, layout))
    assert loaded.rounds == newest
    assert loaded.description is None  # run-wide rounds: nothing more to say
    tensors = {n: t for f in range(layout.count) for n, t in layout.copy_out(f).items()}
    assert set(tensors) == {n for n, _ in model.named_parameters()}
    for name, value in model.named_parameters():
        assert torch.equal(tensors[name], value.detach()), name


def test_a_layout_from_the_manifest_keeps_buffers_and_frozen_apart() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[0].bias.requires_grad_(False)
    manifest = ModelLayout(model, ALGORITHM).manifest("alice", ALGORITHM)
    layout = ModelLayout.from_manifest(manifest)
    assert layout.specs == manifest.fragments
    assert layout.frozen_specs == manifest.frozen
    assert [s.name for s in manifest.frozen] == ["0.bias"]
    buffers = {n for f in range(layout.count) for n in layout.buffer_names(f)}
    assert buffers == {"1.running_mean", "1.running_var"}
    values = {s.name: torch.full(s.shape, 2.0) for s in manifest.fragments[0]}
    layout.load(0, values)
    for name, value in layout.copy_out(0).items():
        assert torch.equal(value, values[name]), name
