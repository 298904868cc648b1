"""RoundCloser on its own: the momentum buffers it reuses across rounds are never overwritten
while something still needs them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.coord.leases import LeaseTracker
from gradientmail.engine.closer import Outcome, RoundCloser
from gradientmail.engine.layout import ModelLayout
from gradientmail.payload import get_tensors, put_tensors
from gradientmail.testing import FaultyMailbox

ALGORITHM = gm.DiLoCo(sync_every=2, fragments=1, outer_lr=0.7, outer_momentum=0.9)
Tensors = dict[str, torch.Tensor]


class Refusing(FaultyMailbox):
    """Refuses (with an error no retry absorbs) the next ``puts`` writes under ``prefix``, and
    the next ``gets`` reads of it."""

    def __init__(self, inner: gm.Mailbox) -> None:
        super().__init__(inner)
        self.prefix = ""
        self.puts = 0
        self.gets = 0

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if self.puts and key.startswith(self.prefix):
            self.puts -= 1
            raise RuntimeError(f"refused: {key}")
        return await super().put_if_absent(key, data)

    async def get(self, key: str) -> bytes | None:
        if self.gets and key.startswith(self.prefix):
            self.gets -= 1
            raise RuntimeError(f"refused: {key}")
        return await super().get(key)


def _bits(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()}


class Fixture:
    """One fragment, learners ``a`` (the closer) and ``b``, and the commits a reference
    computation expects (``DiLoCo.combine`` on fresh copies of every input)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8)
        self.layout = ModelLayout(model, ALGORITHM)
        self.box = Refusing(gm.MemoryMailbox())
        self.closer = RoundCloser(
            self.box,
            self.layout,
            ALGORITHM,
            "a",
            LeaseTracker(60.0),
            quorum_size=1,
            round_timeout=0.0,
            keep_rounds=100,
            emit=lambda event: None,
        )
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        key = self._put(initial)
        commit = p.Commit(0, 0, None, (), key, None, "creator", 0)
        assert asyncio.run(self.box.put_if_absent(p.round_key(0), p.encode(commit)))
        self.expected: list[tuple[Tensors, Tensors | None]] = [(initial, None)]
        self.params: Tensors = initial  # what the training thread holds: the newest commit

    def _put(self, tensors: Mapping[str, torch.Tensor]) -> str:
        return asyncio.run(put_tensors(self.box, tensors))[0]

    def _get(self, key: str) -> Tensors:
        return asyncio.run(get_tensors(self.box, key, self.layout.specs[0]))

    def snapshots(self, r: int) -> tuple[str, Tensors]:
        """Both learners publish a snapshot of round ``r``; returns ``a``'s."""
        base, momentum = self.expected[r - 1]
        contributions = []
        own: tuple[str, Tensors] = ("", {})
        for learner, samples in (("a", 3), ("b", 5)):
            local = {k: v + 0.01 * torch.randn(v.shape) for k, v in base.items()}
            key = self._put(local)
            record = p.Snapshot(r, learner, samples, key, r - 1)
            assert asyncio.run(self.box.put_if_absent(p.snapshot_key(r, learner), p.encode(record)))
            contributions.append((learner, samples, {k: v.clone() for k, v in local.items()}))
            if learner == "a":
                own = (key, local)
        copies = None if momentum is None else {k: v.clone() for k, v in momentum.items()}
        self.expected.append(ALGORITHM.combine(base, copies, contributions))
        return own

    def close(self, r: int, own: tuple[str, Tensors]) -> Outcome:
        outcome = asyncio.run(self.closer.try_close(r, own[0], own[1], self.params))
        assert outcome is not None
        assert outcome.params is not None
        self.params = outcome.params
        return outcome

    def check(self, outcome: Outcome) -> None:
        """The stored commit is bitwise the reference's."""
        want_params, want_momentum = self.expected[outcome.commit.round]
        assert want_momentum is not None
        assert outcome.commit.momentum is not None
        assert _bits(self._get(outcome.commit.params)) == _bits(want_params)
        assert _bits(self._get(outcome.commit.momentum)) == _bits(want_momentum)
        assert outcome.params is not None
        assert _bits(outcome.params) == _bits(want_params)

    def momentum_buffer(self) -> int:
        return self.closer._momentum[0][1]["weight"].data_ptr()


def test_the_closer_reuses_its_momentum_buffer_and_nothing_still_in_use() -> None:
    fx = Fixture()
    outcomes = []
    held: list[dict[str, bytes]] = []
    for r in (1, 2, 3, 4):
        outcome = fx.close(r, fx.snapshots(r))
        fx.check(outcome)
        outcomes.append(outcome)
        held.append(_bits(outcome.params or {}))
        if r == 1:
            buffer = fx.momentum_buffer()
        else:  # the momentum was updated in place: no fresh allocation
            assert fx.momentum_buffer() == buffer
    # Parameters handed to the training thread are never reused: every round's are intact
    # (the newest is the next round's base), and so are the stored payloads.
    for outcome, bits in zip(outcomes, held, strict=True):
        assert _bits(outcome.params or {}) == bits
        fx.check(outcome)


@pytest.mark.parametrize(
    "failure",
    [
        "payload write refused (after the combine)",
        "round record refused (after the payloads)",
        "snapshot read refused (before the combine)",
    ],
)
def test_a_failed_close_leaves_no_overwritten_momentum_behind(failure: str) -> None:
    """A close that fails after combining into the cached momentum must not leave the cache
    naming the old momentum: the retry would combine with the overwritten bytes."""
    fx = Fixture()
    first = fx.close(1, fx.snapshots(1))
    buffer = fx.momentum_buffer()
    own = fx.snapshots(2)
    if failure.startswith("payload"):
        fx.box.prefix, fx.box.puts = p.BLOBS, 1
    elif failure.startswith("round"):
        fx.box.prefix, fx.box.puts = p.ROUNDS, 1
    else:
        fx.box.prefix, fx.box.gets = p.snapshots_prefix(2), 1
    with pytest.raises(RuntimeError, match="refused"):
        fx.close(2, own)
    outcome = fx.close(2, own)  # the retry: our claim still holds
    fx.check(outcome)
    if failure.startswith("snapshot"):  # nothing was written: the cache was kept
        assert fx.momentum_buffer() == buffer
    fx.check(fx.close(3, fx.snapshots(3)))
    fx.check(first)  # the retry downloaded round 1's momentum: it must not write into it


def test_new_parameter_buffers_are_reused_only_once_nothing_refers_to_them() -> None:
    """The training thread keeps only the newest commit's parameters (its reference), so a
    buffer two rounds old is free again and reused; one still viewed anywhere (here a numpy
    array over one tensor, as an encoder's memoryview would be) is not."""
    fx = Fixture()
    pool = fx.closer._params_out
    pointers: list[int] = []
    for r in (1, 2, 3, 4, 5):
        outcome = fx.close(r, fx.snapshots(r))
        fx.check(outcome)
        pointers.append(outcome.params["weight"].data_ptr() if outcome.params else 0)
        del outcome  # like the training thread: only fx.params (the newest) stays
    assert pool.reused >= 2
    assert len(set(pointers)) < len(pointers)  # the same memory served several rounds
    # Now keep an outside reference to the newest parameters' storage and drop fx.params.
    newest = fx.params
    alias = newest["bias"].numpy()
    want = alias.copy()
    fx.params = {k: v.clone() for k, v in newest.items()}
    del newest
    for r in (6, 7, 8):
        fx.check(fx.close(r, fx.snapshots(r)))
    assert (alias == want).all()  # never written while the alias lived
