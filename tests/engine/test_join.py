"""Joining a run: the creator role fails over, and anyone finishes a half-created run.

A creator can die after its claim (no manifest) or after the manifest (initial commits
missing). Either way the next joiner takes over within about one ``lease_timeout`` on its
own (here: injected) clock; a creator that is alive, if slow, is left alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.engine.align import load_newest
from gradientmail.engine.join import establish
from gradientmail.engine.layout import ModelLayout
from gradientmail.payload import put_tensors
from gradientmail.testing import FaultyMailbox
from tests.training import make_model

ALGORITHM = gm.DiLoCo(sync_every=10, fragments=2, outer_lr=0.7, outer_momentum=0.9)
LEASE = 6.0  # the joiners' lease_timeout, in seconds of the fake clock
POLL = 0.2
# A joiner judges others' liveness every tenth of a lease: it takes over at most this late.
TAKEOVER = LEASE + LEASE / 10 + 2 * POLL


class FakeClock:
    """Monotonic seconds that only move when someone sleeps; ``hook`` runs after each sleep
    (what the rest of the world did meanwhile)."""

    def __init__(self, hook: Callable[[float], Awaitable[None]] | None = None) -> None:
        self.now = 0.0
        self.hook = hook

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)
        if self.hook is not None:
            await self.hook(self.now)


def _keys(box: gm.Mailbox, prefix: str = "") -> list[str]:
    return list(asyncio.run(box.list(prefix)))


def _put(box: gm.Mailbox, key: str, data: bytes) -> None:
    assert asyncio.run(box.put_if_absent(key, data))


def _join(
    box: gm.Mailbox, model: torch.nn.Module, learner: str, clock: FakeClock, timeout: float = 120
) -> tuple[p.Manifest, bool]:
    layout = ModelLayout(model, ALGORITHM)
    return asyncio.run(
        establish(
            box,
            layout,
            ALGORITHM,
            learner,
            timeout,
            lease_timeout=LEASE,
            clock=clock,
            sleep=clock.sleep,
            poll=POLL,
        )
    )


def _initial(box: gm.Mailbox) -> list[p.Commit]:
    found = []
    for f in range(ALGORITHM.fragments):
        key = p.round_key(f)
        found.append(p.decode_commit(key, asyncio.run(box.get(key))))
    return found


def _run_params(box: gm.Mailbox) -> dict[str, torch.Tensor]:
    """The run's parameters as a fresh node gets them (the newest commit per fragment)."""
    model = make_model(seed=99)
    _, tensors = asyncio.run(load_newest(box, ModelLayout(model, ALGORITHM)))
    return {name: value for values in tensors.values() for name, value in values.items()}


def _equal(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> bool:
    own = dict(model.named_parameters())
    return own.keys() == params.keys() and all(torch.equal(own[n], params[n]) for n in params)


def _joins(box: gm.Mailbox, learner: str, seed: int) -> torch.nn.Module:
    """A real Session joins (the run is complete: no waiting) and holds the run's values."""
    model = make_model(seed=seed)
    with gm.Session(model, algorithm=ALGORITHM, mailbox=box, learner_id=learner, join_timeout=10):
        pass
    return model


async def _write_initial(box: gm.Mailbox, model: torch.nn.Module, writer: str) -> None:
    layout = ModelLayout(model, ALGORITHM)
    for f in range(layout.count):
        key, _ = await put_tensors(box, layout.copy_out(f))
        commit = p.Commit(f, f, None, (), key, None, writer)
        await box.put_if_absent(p.round_key(f), p.encode(commit))


# -- keys --------------------------------------------------------------------------------------


def test_creator_claim_keys_are_siblings_in_attempt_order() -> None:
    keys = [p.creator_key(n) for n in (0, 1, 2, 10, 9999)]
    assert keys[:2] == ["claims/creator", "claims/creator-0001"]
    assert keys == sorted(keys)  # byte order is attempt order
    assert [p.parse_creator_attempt(k) for k in keys] == [0, 1, 2, 10, 9999]
    assert all(not k.startswith(p.CREATOR + "/") for k in keys)  # never a child of attempt 0
    for bad in ("claims/creator-1", "claims/creator-0000", "claims/creatorx", "claims/0000"):
        with pytest.raises(gm.ProtocolError):
            p.parse_creator_attempt(bad)


# -- a creator that died after its claim, before the manifest ----------------------------------


def test_a_creator_that_died_before_the_manifest_is_replaced_within_one_lease(
    mailbox: gm.Mailbox,
) -> None:
    _put(mailbox, p.CREATOR, p.encode(p.CreatorClaim("ghost")))  # claimed, then died: no beats
    clock = FakeClock()
    model = make_model(seed=1)
    manifest, creator = _join(mailbox, model, "a", clock)
    assert creator
    assert manifest.creator == "a"
    assert LEASE <= clock.now <= TAKEOVER, f"took {clock.now} s of a {LEASE} s lease"
    assert _keys(mailbox, p.CREATOR) == [p.CREATOR, p.creator_key(1)]
    assert [c.closer for c in _initial(mailbox)] == ["a", "a"]
    assert _equal(model, _run_params(mailbox))
    # Everyone joins the run it created: a new node, and the dead creator's id restarted.
    assert _equal(_joins(mailbox, "b", seed=2), _run_params(mailbox))
    assert _equal(_joins(mailbox, "ghost", seed=3), _run_params(mailbox))


def test_a_lost_response_on_the_replacement_claim_is_recognised_as_ours(
    mailbox: gm.Mailbox,
) -> None:
    _put(mailbox, p.CREATOR, p.encode(p.CreatorClaim("ghost")))
    faulty = FaultyMailbox(mailbox).lose_response("put_if_absent", 1)  # claims/creator-0001
    clock = FakeClock()
    manifest, creator = _join(faulty, make_model(seed=1), "a", clock)
    assert creator
    assert manifest.creator == "a"
    assert [i.key for i in faulty.injected] == [p.creator_key(1)]
    assert _keys(mailbox, p.CREATOR) == [p.CREATOR, p.creator_key(1)]


def test_two_joiners_replacing_a_dead_creator_agree_on_one_run() -> None:
    box = gm.MemoryMailbox()
    _put(box, p.CREATOR, p.encode(p.CreatorClaim("ghost")))
    models = {"a": make_model(seed=1), "b": make_model(seed=2)}
    clocks = {name: FakeClock() for name in models}

    async def both() -> list[tuple[p.Manifest, bool]]:
        return await asyncio.gather(
            *(
                establish(
                    box,
                    ModelLayout(model, ALGORITHM),
                    ALGORITHM,
                    name,
                    120,
                    lease_timeout=LEASE,
                    clock=clocks[name],
                    sleep=clocks[name].sleep,
                    poll=POLL,
                )
                for name, model in models.items()
            )
        )

    results = asyncio.run(both())
    assert results[0][0] == results[1][0]
    assert sorted(creator for _, creator in results) == [False, True]
    assert _keys(box, p.CREATOR) == [p.CREATOR, p.creator_key(1)]  # one replacement claim
    # Each initial commit is one node's whole fragment; both load the same values.
    params = _run_params(box)
    for f, commit in enumerate(_initial(box)):
        own = dict(models[commit.closer].named_parameters())
        names = ModelLayout(models["a"], ALGORITHM).fragments[f]
        assert all(torch.equal(own[n], params[n]) for n in names)


def test_a_slow_creator_that_beats_is_not_replaced() -> None:
    """The holder renews its lease (some future Session may beat while joining): joiners
    wait as long as it does, and never claim a second attempt."""
    box = gm.MemoryMailbox()
    _put(box, p.CREATOR, p.encode(p.CreatorClaim("slow")))
    slow = make_model(seed=7)
    beats = [0]

    async def world(now: float) -> None:
        while beats[0] * LEASE / 3 <= now:  # the holder beats every lease/3
            await box.put_if_absent(p.beat_key("slow", beats[0]), p.encode(p.Beat("slow")))
            beats[0] += 1
        if now >= 4 * LEASE and await box.get(p.MANIFEST) is None:
            layout = ModelLayout(slow, ALGORITHM)
            await box.put_if_absent(p.MANIFEST, p.encode(layout.manifest("slow", ALGORITHM)))
            await _write_initial(box, slow, "slow")

    clock = FakeClock(world)
    manifest, creator = _join(box, make_model(seed=1), "a", clock)
    assert (manifest.creator, creator) == ("slow", False)
    assert clock.now >= 4 * LEASE
    assert _keys(box, p.CREATOR) == [p.CREATOR]
    assert _equal(slow, _run_params(box))


# -- a creator that died after the manifest, before (all) initial commits ----------------------


def _half_created(box: gm.Mailbox, committed: int) -> torch.nn.Module:
    """What a creator leaves when it dies after its manifest and ``committed`` initial
    commits (it never beat: a Session beats only after joining)."""
    ghost = make_model(seed=0)
    layout = ModelLayout(ghost, ALGORITHM)
    _put(box, p.CREATOR, p.encode(p.CreatorClaim("ghost")))
    _put(box, p.MANIFEST, p.encode(layout.manifest("ghost", ALGORITHM)))
    for f in range(committed):
        key, _ = asyncio.run(put_tensors(box, layout.copy_out(f)))
        _put(box, p.round_key(f), p.encode(p.Commit(f, f, None, (), key, None, "ghost")))
    return ghost


@pytest.mark.parametrize("committed", [0, 1])
def test_a_joiner_finishes_a_creator_that_died_after_the_manifest(
    mailbox: gm.Mailbox, committed: int
) -> None:
    ghost = _half_created(mailbox, committed)
    clock = FakeClock()
    model = make_model(seed=1)
    manifest, creator = _join(mailbox, model, "a", clock)
    assert (manifest.creator, creator) == ("ghost", False)
    assert LEASE <= clock.now <= TAKEOVER, f"took {clock.now} s of a {LEASE} s lease"
    closers = [c.closer for c in _initial(mailbox)]
    assert closers == ["ghost"] * committed + ["a"] * (2 - committed)
    params = _run_params(mailbox)
    for f, writer in enumerate((ghost, model)[0 if f < committed else 1] for f in range(2)):
        names = ModelLayout(model, ALGORITHM).fragments[f]
        own = dict(writer.named_parameters())
        assert all(torch.equal(own[n], params[n]) for n in names)
    # A second joiner and the original creator's id, restarted, both join that run.
    assert _equal(_joins(mailbox, "b", seed=2), params)
    assert _equal(_joins(mailbox, "ghost", seed=3), params)
    assert _keys(mailbox, p.CREATOR) == [p.CREATOR]  # nobody had to claim the creator role


def test_the_restarted_creator_finishes_its_own_run_at_once() -> None:
    """The same learner id finds the manifest it wrote and writes the initial commits
    without waiting for anyone (before: it waited for them until join_timeout)."""
    box = gm.MemoryMailbox()
    _half_created(box, 0)
    model = make_model(seed=5)
    with gm.Session(model, algorithm=ALGORITHM, mailbox=box, learner_id="ghost", join_timeout=3):
        pass
    assert [c.closer for c in _initial(box)] == ["ghost", "ghost"]
    assert _equal(model, _run_params(box))


def test_a_creator_still_uploading_is_not_replaced() -> None:
    """A large upload stores a part every few seconds: as long as blobs keep appearing (or
    initial commits land), a joiner waits, however long the upload takes."""
    box = gm.MemoryMailbox()
    ghost = _half_created(box, 0)
    parts = [0]

    async def world(now: float) -> None:
        while parts[0] * LEASE / 2 <= now and now < 5 * LEASE:  # a part every lease/2
            await box.put_if_absent(p.blob_key(f"{parts[0]:064x}"), b"part")
            parts[0] += 1
        if now >= 5 * LEASE and await box.get(p.round_key(1)) is None:
            await _write_initial(box, ghost, "ghost")

    clock = FakeClock(world)
    manifest, creator = _join(box, make_model(seed=1), "a", clock)
    assert (manifest.creator, creator) == ("ghost", False)
    assert clock.now >= 5 * LEASE
    assert [c.closer for c in _initial(box)] == ["ghost", "ghost"]


def test_a_joiner_whose_model_differs_never_finishes_the_run() -> None:
    box = gm.MemoryMailbox()
    _half_created(box, 0)
    other = make_model(seed=1, width=32)
    with pytest.raises(gm.ProtocolError, match="does not match the run"):
        _join(box, other, "a", FakeClock())
    assert _keys(box, p.ROUNDS) == []


def test_a_run_nobody_finishes_times_out_naming_what_it_waited_for() -> None:
    box = gm.MemoryMailbox()
    _put(box, p.CREATOR, p.encode(p.CreatorClaim("slow")))

    async def world(now: float) -> None:  # alive (it beats) but never writes its manifest
        await box.put_if_absent(p.beat_key("slow", int(now * 10)), p.encode(p.Beat("slow")))

    clock = FakeClock(world)
    with pytest.raises(TimeoutError, match="creator slow"):
        _join(box, make_model(seed=1), "a", clock, timeout=3 * LEASE)
    assert 3 * LEASE <= clock.now <= 3 * LEASE + 1


# -- the tools still read a run whose creator failed over --------------------------------------


def test_sweep_and_status_read_a_run_created_by_a_replacement_claim() -> None:
    from gradientmail.cli.housekeeping import plan_sweep
    from gradientmail.inspect import RunWatcher

    box = gm.MemoryMailbox()
    _put(box, p.CREATOR, p.encode(p.CreatorClaim("ghost")))
    _join(box, make_model(seed=1), "a", FakeClock())
    plan = asyncio.run(plan_sweep(box, "memory://run", keep_rounds=1, orphans=True))
    doomed = plan.keys()
    assert p.creator_key(1) not in doomed
    assert p.CREATOR not in doomed
    view = asyncio.run(RunWatcher(box).poll())
    assert (view.exists, view.creator, view.fragments) == (True, "a", ALGORITHM.fragments)
