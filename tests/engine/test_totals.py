"""Running totals in commit records (``Commit.totals``): the wire, the closer that writes
them, ``verify`` that checks them, and a status read from them alone."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import threading

import pytest

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.events import Counters
from gradientmail.inspect import RunWatcher
from gradientmail.mailbox.metered import Metered
from gradientmail.wire.records import NO_TOTALS, Totals
from tests.engine.test_closer import Fixture
from tests.training import LOCKSTEP, Learner, commits, run_learners, verify_all

KEY = p.round_key(5)


def sha(text: str) -> str:
    return p.blob_key(hashlib.sha256(text.encode()).hexdigest())


def record(totals: Totals | None) -> p.Commit:
    contributors = (p.Contribution("a", 16, sha("a")), p.Contribution("b", 32, sha("b")))
    return p.Commit(5, 1, 3, contributors, sha("params"), sha("momentum"), "a", totals=totals)


def replace_object(box: gm.Mailbox, key: str, data: bytes) -> None:
    asyncio.run(box.delete([key]))
    assert asyncio.run(box.put_if_absent(key, data))


# -- the wire ----------------------------------------------------------------------------------


def test_totals_round_trip_and_are_written_only_when_known() -> None:
    with_totals = record(Totals(3, 144))
    wire = with_totals.to_wire()
    assert wire["totals"] == {"rounds": 3, "samples": 144}
    assert p.decode_commit(KEY, p.encode(with_totals)) == with_totals

    without = record(None)
    assert "totals" not in without.to_wire()  # what earlier releases wrote, byte for byte
    assert p.decode_commit(KEY, p.encode(without)) == without
    assert p.decode_commit(KEY, p.encode(without)).totals is None


def test_a_record_from_before_totals_decodes() -> None:
    wire = dict(record(None).to_wire())
    old = json.dumps(wire).encode()
    assert p.decode_commit(KEY, old).totals is None
    assert p.decode_commit(KEY, old).running_totals(2) is None  # a training round: unknown
    initial = p.Commit(1, 1, None, (), sha("params"), None, "a")
    assert initial.running_totals(2) == NO_TOTALS  # an initial commit's are zero


@pytest.mark.parametrize(
    "totals",
    [
        {"rounds": -1, "samples": 3},
        {"rounds": 1, "samples": -3},
        {"rounds": "1", "samples": 3},
        {"rounds": 1, "samples": 2.5},
        {"rounds": True, "samples": 3},
        {"rounds": 1},
        [1, 3],
        None,
    ],
)
def test_malformed_totals_name_the_record(totals: object) -> None:
    wire = {**record(None).to_wire(), "totals": totals}
    with pytest.raises(gm.ProtocolError, match=r"^rounds/0000000005"):
        p.decode_commit(KEY, json.dumps(wire).encode())


# -- the closer --------------------------------------------------------------------------------


def test_the_closer_adds_its_round_to_the_base_totals() -> None:
    fx = Fixture()  # one fragment; each round combines a's 3 samples and b's 5
    for r in (1, 2, 3):
        outcome = fx.close(r, fx.snapshots(r))
        assert outcome.commit.totals == Totals(r, 8 * r)
        stored = p.decode_commit(p.round_key(r), asyncio.run(fx.box.get(p.round_key(r))))
        assert stored.totals == Totals(r, 8 * r)


def test_a_base_without_totals_gives_none() -> None:
    """A base written before totals existed: the closer cannot know them, and writes none."""
    fx = Fixture()
    fx.close(1, fx.snapshots(1))
    key = p.round_key(1)
    base = p.decode_commit(key, asyncio.run(fx.box.get(key)))
    replace_object(fx.box, key, p.encode(dataclasses.replace(base, totals=None)))
    fx.closer._records.clear()  # as a closer that did not write round 1 itself
    outcome = fx.close(2, fx.snapshots(2))
    assert outcome.commit.totals is None
    assert "totals" not in json.loads(asyncio.run(fx.box.get(p.round_key(2))) or b"{}")


# -- a run: every commit carries its fragment's running totals, and verify checks them ----------


@pytest.fixture(scope="module")
def trained() -> gm.MemoryMailbox:
    """Two learners that start together in LOCKSTEP: every round closes as soon as both
    contributed (never by waiting out a round_timeout for one that is slow to join), so the
    run has every sync point's round, whatever the delays on a loaded machine."""
    box = gm.MemoryMailbox()
    learners = [Learner("a", 40, seed=1), Learner("b", 40, seed=2)]
    run_learners(learners, box, gm.DiLoCo(sync_every=4, fragments=2), together=True, **LOCKSTEP)
    return box


def test_every_commit_of_a_run_carries_its_running_totals(trained: gm.MemoryMailbox) -> None:
    found = commits(trained)
    assert len([c for c in found if c.round >= 2]) >= 6
    running = {0: NO_TOTALS, 1: NO_TOTALS}
    for commit in found:
        if commit.round < 2:
            assert commit.totals is None  # initial commits: zero, and not written
            continue
        running[commit.fragment] = running[commit.fragment].after(commit.samples)
        assert commit.totals == running[commit.fragment], commit.round
    verify_all(trained)  # every record's totals agree with its base's


def test_a_status_from_the_newest_records_alone(trained: gm.MemoryMailbox) -> None:
    found = commits(trained)
    counters = Counters()
    view = asyncio.run(RunWatcher(Metered(trained, counters, threading.Lock())).poll())
    assert counters.requests["get:rounds"] == 2  # one record per fragment
    training = [c for c in found if c.round >= 2]
    assert view.rounds_committed == len(training)
    assert view.samples_committed == sum(c.samples for c in training) // 2
    # Each trained sample counted once: no more than the learners trained (2 x 40 x 16).
    assert 0 < view.samples_committed <= 2 * 40 * 16


def test_verify_reports_wrong_totals(trained: gm.MemoryMailbox) -> None:
    box = gm.MemoryMailbox()
    for key in asyncio.run(trained.list("")):  # a copy to tamper with
        assert asyncio.run(box.put_if_absent(key, asyncio.run(trained.get(key)) or b""))
    r = max(c.round for c in commits(box))
    key = p.round_key(r)
    good = p.decode_commit(key, asyncio.run(box.get(key)))
    assert good.totals is not None
    asyncio.run(gm.verify.verify_commit(box, r))

    for wrong in (
        Totals(good.totals.rounds, good.totals.samples + 1),
        Totals(good.totals.rounds + 1, good.totals.samples),
    ):
        replace_object(box, key, p.encode(dataclasses.replace(good, totals=wrong)))
        with pytest.raises(gm.ProtocolError, match=r"rounds/\d+: totals .* its base's plus"):
            asyncio.run(gm.verify.verify_commit(box, r))

    # Totals on a record whose base has none: nothing they could have been added to.
    replace_object(box, key, p.encode(good))
    assert good.base is not None
    base_key = p.round_key(good.base)
    base = p.decode_commit(base_key, asyncio.run(box.get(base_key)))
    replace_object(box, base_key, p.encode(dataclasses.replace(base, totals=None)))
    with pytest.raises(gm.ProtocolError, match="has none to add to"):
        asyncio.run(gm.verify.verify_commit(box, r))
    # A record without totals (an older closer's) still verifies.
    if base.round >= 2:
        asyncio.run(gm.verify.verify_commit(box, base.round))

    # An initial commit's totals can only be zero.
    initial = p.decode_commit(p.round_key(0), asyncio.run(box.get(p.round_key(0))))
    replace_object(box, p.round_key(0), p.encode(dataclasses.replace(initial, totals=NO_TOTALS)))
    asyncio.run(gm.verify.verify_commit(box, 0))
    replace_object(box, p.round_key(0), p.encode(dataclasses.replace(initial, totals=Totals(1, 1))))
    with pytest.raises(gm.ProtocolError, match="initial commit's totals must be zero"):
        asyncio.run(gm.verify.verify_commit(box, 0))
