"""gradientmail.inspect: a read-only view of a run, from records written straight into a mailbox."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.events import Counters
from gradientmail.inspect import STALLING_FRACTION, RunView, RunWatcher, SyncTotals, inspect_run
from gradientmail.mailbox.metered import Metered
from gradientmail.testing import FaultyMailbox
from gradientmail.wire.records import NO_TOTALS, Totals

P = 2  # fragments in every run built here


def sha(text: str) -> str:
    """A payload key, as records carry them: ``blobs/{sha256}``."""
    return p.blob_key(hashlib.sha256(text.encode()).hexdigest())


def fake_clock() -> tuple[list[float], Callable[[], float]]:
    now = [100.0]
    return now, lambda: now[0]


class Run:
    """Writes protocol records directly, as the nodes of a run would."""

    def __init__(self, box: gm.Mailbox, *, totals: bool = False) -> None:
        self.box = box
        self.totals = totals  # whether commits carry running totals (older ones do not)
        self.running: dict[int, Totals] = {}  # fragment -> its totals so far

    def put(self, key: str, data: bytes) -> None:
        assert asyncio.run(self.box.put_if_absent(key, data))

    def claim(self, creator: str = "alice") -> None:
        self.put(p.CREATOR, p.encode(p.CreatorClaim(creator)))

    def manifest(self, creator: str = "alice") -> None:
        specs = tuple((p.TensorSpec(f"w{f}", (4, 2), "float32"),) for f in range(P))
        algorithm = {"name": "diloco", "outer_lr": 0.7}
        self.put(p.MANIFEST, p.encode(p.Manifest(creator, algorithm, specs)))

    def create(self, creator: str = "alice") -> None:
        """Claim, manifest and the initial commits (rounds 0 .. P-1)."""
        self.claim(creator)
        self.manifest(creator)
        for r in range(P):
            self.commit(r, {})

    def commit(self, r: int, contributors: dict[str, int], fragment: int | None = None) -> None:
        totals = None
        if r >= P:
            totals = self.running.get(r % P, NO_TOTALS).after(sum(contributors.values()))
            self.running[r % P] = totals
        record = p.Commit(
            round=r,
            fragment=r % P if fragment is None else fragment,
            base=r - P if r >= P else None,
            contributors=tuple(
                p.Contribution(learner, samples, sha(f"{r}/{learner}"))
                for learner, samples in sorted(contributors.items())
            ),
            params=sha(f"params {r}"),
            momentum=sha(f"momentum {r}") if r >= P else None,
            closer="alice",
            totals=totals if self.totals else None,
        )
        self.put(p.round_key(r), p.encode(record))

    def beat(self, learner: str, n: int, steps: int = 0, samples: int = 0, **counters: Any) -> None:
        """A beat as the Session writes it; ``counters``: sync_points, contributed,
        waited_s, skipped."""
        leaving = n == p.LEAVING_BEAT
        record = p.Beat(learner, steps, samples, leaving, **counters)
        self.put(p.beat_key(learner, n), p.encode(record))

    def old_beat(self, learner: str, n: int, steps: int = 0, samples: int = 0) -> None:
        """A beat as a release before the sync-point counters wrote it."""
        wire = {"learner": learner, "steps": steps, "samples": samples, "leaving": False}
        self.put(p.beat_key(learner, n), json.dumps(wire).encode())

    def snapshot(self, r: int, learner: str, samples: int = 8) -> None:
        record = p.Snapshot(r, learner, samples, sha(f"snap {r}/{learner}"), max(r - P, 0))
        self.put(p.snapshot_key(r, learner), p.encode(record))


def poll(watcher: RunWatcher) -> RunView:
    return asyncio.run(watcher.poll())


def test_empty_prefix_does_not_exist() -> None:
    view = asyncio.run(inspect_run(gm.MemoryMailbox()))
    assert view == RunView(
        exists=False,
        creator=None,
        fragments=None,
        algorithm=None,
        rounds_committed=0,
        newest_round=None,
        newest_per_fragment={},
        last_contributors=(),
        samples_committed=0,
        learners=(),
        live_learners=0,
        open_rounds={},
        seconds_since_commit=None,
        samples_per_second=None,
    )


def test_creator_claim_alone_exists() -> None:
    run = Run(gm.MemoryMailbox())
    run.claim("bob")
    view = asyncio.run(inspect_run(run.box))
    assert (view.exists, view.creator, view.fragments) == (True, "bob", None)


def test_manifest_only_has_fragments_and_no_rounds() -> None:
    run = Run(gm.MemoryMailbox())
    run.claim()
    run.manifest()
    view = asyncio.run(inspect_run(run.box))
    assert view.exists
    assert view.creator == "alice"
    assert view.fragments == P
    assert view.algorithm == {"name": "diloco", "outer_lr": 0.7}
    assert view.rounds_committed == 0
    assert view.newest_round is None
    assert view.newest_per_fragment == {}
    assert view.seconds_since_commit is None


def test_initial_commits_are_not_training_rounds() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    view = asyncio.run(inspect_run(run.box))
    assert view.rounds_committed == 0
    assert view.newest_round is None
    assert view.newest_per_fragment == {0: 0, 1: 1}
    assert view.last_contributors == ()
    assert view.seconds_since_commit is not None
    assert view.seconds_since_commit >= 0.0
    assert not view.commit_age_known  # there at the first poll: its age is unknown
    # First seen at this poll: no time passed on the observer's clock.
    _, clock = fake_clock()
    watched = asyncio.run(RunWatcher(run.box, clock=clock).poll())
    assert watched.seconds_since_commit == 0.0
    assert not watched.commit_age_known


def test_full_run_over_every_backend(mailbox: gm.Mailbox) -> None:
    run = Run(mailbox)
    run.create()
    run.commit(2, {"l1": 10, "l2": 20})
    run.commit(3, {"l1": 5})
    run.commit(4, {"l2": 7, "l3": 1})
    run.snapshot(3, "l3")  # late snapshot for a committed round: not open
    run.snapshot(5, "l1")
    run.snapshot(5, "l2")
    run.snapshot(6, "l2")
    run.beat("l1", 3, steps=30, samples=15)
    run.beat("l1", 4, steps=40, samples=20)
    run.beat("l2", 1, steps=12, samples=27)
    run.beat("l3", p.LEAVING_BEAT, steps=2, samples=1)
    faulty = FaultyMailbox(mailbox)
    view = asyncio.run(inspect_run(faulty))
    assert (view.exists, view.creator, view.fragments) == (True, "alice", P)
    assert view.rounds_committed == 3
    assert view.newest_round == 4
    assert view.newest_per_fragment == {0: 4, 1: 3}
    assert view.last_contributors == ("l2", "l3")
    assert view.samples_committed == (10 + 20 + 5 + 7 + 1) // P  # each sample counted once
    assert view.open_rounds == {5: ("l1", "l2"), 6: ("l2",)}
    assert [lv.learner for lv in view.learners] == ["l1", "l2", "l3"]
    l1, l2, l3 = view.learners
    assert (l1.live, l1.beat, l1.steps, l1.samples, l1.leaving) == (True, 4, 40, 20, False)
    assert (l2.live, l2.beat, l2.steps, l2.samples) == (True, 1, 12, 27)
    assert (l3.live, l3.leaving, l3.beat, l3.steps) == (False, True, p.LEAVING_BEAT, 2)
    assert view.live_learners == 2
    assert (faulty.calls["put_if_absent"], faulty.calls["delete"]) == (0, 0)  # read-only


def test_incremental_poll_reads_only_new_records() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    run.commit(2, {"l1": 4})
    run.beat("l1", 1)
    run.beat("l2", 1)
    faulty = FaultyMailbox(run.box)
    watcher = RunWatcher(faulty)
    poll(watcher)
    first = faulty.calls["get"]
    assert first == 1 + 3 + 2  # the manifest (it names the creator), 3 commits, 2 beats

    poll(watcher)
    assert faulty.calls["get"] == first  # nothing new: nothing read

    run.commit(3, {"l1": 4, "l2": 6})
    run.commit(4, {"l2": 1})
    run.beat("l2", 2, steps=9)
    view = poll(watcher)
    assert faulty.calls["get"] == first + 2 + 1  # 2 new commits, 1 changed beat
    assert view.rounds_committed == 3
    assert view.samples_committed == (4 + 4 + 6 + 1) // P
    assert view.learners[1].steps == 9
    assert (faulty.calls["put_if_absent"], faulty.calls["delete"]) == (0, 0)


def test_truncated_commit_names_the_key() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    run.commit(2, {"l1": 4})
    whole = p.encode(
        p.Commit(3, 1, 1, (p.Contribution("l1", 2, sha("x")),), sha("p"), sha("m"), "alice")
    )
    run.put(p.round_key(3), whole[: len(whole) // 2])
    with pytest.raises(gm.ProtocolError, match="rounds/0000000003"):
        asyncio.run(inspect_run(run.box))


@pytest.mark.parametrize(
    "change",
    [
        {"params": "not-a-blob-key"},  # blob_sha's own error does not name the record
        {"contributors": [{"learner": "bad id", "samples": 1, "payload": sha("x")}]},  # ValueError
    ],
)
def test_invalid_commit_field_names_the_key(change: dict[str, object]) -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    wire = {**p.Commit(2, 0, 0, (), sha("p"), sha("m"), "alice").to_wire(), **change}
    run.put(p.round_key(2), json.dumps(wire).encode())
    with pytest.raises(gm.ProtocolError, match=r"^rounds/0000000002: "):
        asyncio.run(inspect_run(run.box))


def test_commit_for_the_wrong_fragment_is_rejected() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    run.commit(3, {"l1": 4}, fragment=0)
    with pytest.raises(gm.ProtocolError, match=r"rounds/0000000003.*fragment 1"):
        asyncio.run(inspect_run(run.box))


def test_malformed_beat_names_the_key() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    run.put(p.beat_key("l1", 1), b'{"learner": "l1", "steps": -1}')
    with pytest.raises(gm.ProtocolError, match="leases/l1/0000000001"):
        asyncio.run(inspect_run(run.box))


def test_swept_beat_leaves_steps_unknown() -> None:
    class SweptBeats(gm.MemoryMailbox):
        async def get(self, key: str) -> bytes | None:
            return None if key.startswith(p.LEASES) else await super().get(key)

    run = Run(SweptBeats())
    run.create()
    run.beat("l1", 5, steps=3)
    (l1,) = asyncio.run(inspect_run(run.box)).learners
    assert (l1.live, l1.beat, l1.steps, l1.samples) == (True, 5, None, None)


def test_unavailable_propagates_and_the_next_poll_goes_on() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    run.commit(2, {"l1": 4})
    run.commit(3, {"l1": 6})
    faulty = FaultyMailbox(run.box).fail_before("list", 2)  # the leases/ listing
    watcher = RunWatcher(faulty)
    with pytest.raises(gm.MailboxUnavailable):
        poll(watcher)
    view = poll(watcher)
    assert (view.rounds_committed, view.samples_committed) == (2, 10 // P)  # counted once
    assert faulty.calls["get"] == 1 + 4  # the manifest, 4 commits: none read twice


def test_liveness_follows_the_observer_clock() -> None:
    now, clock = fake_clock()
    run = Run(gm.MemoryMailbox())
    run.create()
    run.beat("l1", 1)
    run.beat("l2", 1)
    watcher = RunWatcher(run.box, lease_timeout=10.0, clock=clock)

    view = poll(watcher)
    assert [lv.live for lv in view.learners] == [True, True]
    assert view.live_learners == 2

    now[0] += 8.0
    run.beat("l1", 2)  # l1 beats again; l2 stays silent
    view = poll(watcher)
    assert [lv.live for lv in view.learners] == [True, True]
    assert [lv.seconds_since_beat for lv in view.learners] == [0.0, 8.0]

    now[0] += 4.0  # l2's beat is 12 s old on our clock: lapsed
    view = poll(watcher)
    l1, l2 = view.learners
    assert (l1.live, l1.seconds_since_beat) == (True, 4.0)
    assert (l2.live, l2.seconds_since_beat, l2.leaving) == (False, 12.0, False)
    assert view.live_learners == 1

    run.beat("l1", p.LEAVING_BEAT)  # leaving: not live at once, without waiting
    view = poll(watcher)
    l1, _ = view.learners
    assert (l1.live, l1.leaving, l1.seconds_since_beat) == (False, True, 0.0)
    assert view.live_learners == 0

    run.beat("l2", 2)  # a lapsed learner that beats again is live again
    assert poll(watcher).learners[1].live


def test_commit_age_and_throughput_on_the_observer_clock() -> None:
    now, clock = fake_clock()
    run = Run(gm.MemoryMailbox())
    run.create()
    run.commit(2, {"l1": 100})  # history from before we watched
    watcher = RunWatcher(run.box, clock=clock)
    view = poll(watcher)
    assert view.seconds_since_commit == 0.0
    assert view.samples_committed == 100 // P  # once, not once per fragment
    assert view.samples_per_second is None  # one change point is not a rate

    now[0] += 5.0
    view = poll(watcher)
    assert view.seconds_since_commit == 5.0
    assert view.samples_per_second is None

    now[0] += 5.0
    run.commit(3, {"l1": 30, "l2": 20})
    view = poll(watcher)
    assert view.seconds_since_commit == 0.0
    assert view.samples_per_second == pytest.approx(50 / P / 10.0)

    now[0] += 3.0
    view = poll(watcher)  # an unchanged poll keeps the last rate
    assert view.samples_per_second == pytest.approx(2.5)
    assert view.seconds_since_commit == 3.0

    now[0] += 2.0
    run.commit(4, {"l1": 60})
    assert poll(watcher).samples_per_second == pytest.approx(60 / P / 5.0)


def test_view_mappings_are_read_only() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    view = asyncio.run(inspect_run(run.box))
    with pytest.raises(TypeError):
        view.newest_per_fragment[0] = 9  # type: ignore[index]


def test_out_of_order_commits_keep_the_newest_round() -> None:
    """Round 3 (fragment 1) lands before round 2 (fragment 0): the view never goes back."""
    box = gm.MemoryMailbox()
    blob = p.blob_key("0" * 64)
    specs = tuple((p.TensorSpec(f"w{f}", (2,), "float32"),) for f in range(2))

    async def put(key: str, record: object) -> None:
        assert await box.put_if_absent(key, p.encode(record))

    async def scenario() -> tuple[RunView, RunView, RunView]:
        await put(p.CREATOR, p.CreatorClaim("a"))
        await put(p.MANIFEST, p.Manifest("a", {"name": "diloco"}, specs))
        for r in range(2):
            await put(p.round_key(r), p.Commit(r, r, None, (), blob, None, "a"))
        watcher = RunWatcher(box)
        await put(
            p.round_key(3), p.Commit(3, 1, 1, (p.Contribution("b", 5, blob),), blob, blob, "b")
        )
        first = await watcher.poll()
        await put(
            p.round_key(2), p.Commit(2, 0, 0, (p.Contribution("a", 7, blob),), blob, blob, "a")
        )
        return first, await watcher.poll(), await RunWatcher(box).poll()

    first, second, fresh = asyncio.run(scenario())
    assert (first.newest_round, first.rounds_committed) == (3, 1)
    assert (second.newest_round, second.last_contributors, second.rounds_committed) == (
        3,
        ("b",),
        2,
    )
    assert (fresh.newest_round, fresh.last_contributors, fresh.samples_committed) == (3, ("b",), 6)


# -- sync points, from each learner's newest beat ---------------------------------------------


def test_sync_point_counters_per_learner_and_summed(mailbox: gm.Mailbox) -> None:
    run = Run(mailbox)
    run.create()
    run.commit(2, {"l1": 10, "l2": 10})
    run.beat("l1", 1, steps=20, sync_points=2, contributed=2, waited_s=0.5)
    run.beat("l1", 2, steps=40, sync_points=4, contributed=4, waited_s=1.25)  # the newest
    run.beat("l2", 1, steps=40, sync_points=4, contributed=1, waited_s=0.0, skipped=3)
    run.beat("l3", p.LEAVING_BEAT, steps=8, sync_points=1, contributed=1, waited_s=2.0)
    view = asyncio.run(inspect_run(mailbox))
    l1, l2, l3 = view.learners
    counters = [(v.sync_points, v.contributed, v.waited_s, v.skipped) for v in view.learners]
    assert counters == [(4, 4, 1.25, 0), (4, 1, 0.0, 3), (1, 1, 2.0, 0)]
    flags = [(v.skipping, v.stalling) for v in view.learners]
    assert flags == [(False, False), (True, False), (False, False)]
    # Summed over every learner known, the one that left included (a finished run keeps them).
    assert view.sync == SyncTotals(
        sync_points=9, contributed=6, waited_s=3.25, skipped=3, skipping=("l2",), stalling=()
    )
    assert (l1.waiting_fraction, l2.waiting_fraction, l3.waiting_fraction) == (None, None, None)


def test_beats_without_the_counters_read_as_zero() -> None:
    """A learner of an earlier release writes beats without the counters: they decode."""
    run = Run(gm.MemoryMailbox())
    run.create()
    run.old_beat("old", 3, steps=12, samples=6)
    run.beat("new", 1, steps=12, samples=6, sync_points=2, contributed=2)
    new, old = asyncio.run(inspect_run(run.box)).learners  # sorted by id
    assert (old.steps, old.samples, old.sync_points, old.contributed) == (12, 6, 0, 0)
    assert (old.waited_s, old.skipped, old.skipping, old.stalling) == (0.0, 0, False, False)
    assert (new.sync_points, new.contributed) == (2, 2)
    data = asyncio.run(run.box.get(p.beat_key("old", 3)))
    assert p.decode_beat(p.beat_key("old", 3), data) == p.Beat("old", 12, 6, False)
    # And what the Session writes now round-trips, with the keyword names it uses.
    beat = p.Beat("x", 1, 2, False, sync_points=3, contributed=2, waited_s=0.125, skipped=1)
    assert p.decode_beat(p.beat_key("x", 1), p.encode(beat)) == beat


@pytest.mark.parametrize(
    "change",
    [
        {"sync_points": -1},
        {"contributed": "3"},
        {"skipped": 1.5},
        {"waited_s": -0.5},
        {"waited_s": "1"},
        {"waited_s": True},
    ],
)
def test_malformed_sync_counters_name_the_beat(change: dict[str, object]) -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    wire = {**p.Beat("l1", 1, 1).to_wire(), **change}
    run.put(p.beat_key("l1", 4), json.dumps(wire).encode())
    with pytest.raises(gm.ProtocolError, match=r"^leases/l1/0000000004: "):
        asyncio.run(inspect_run(run.box))
    with pytest.raises(gm.ProtocolError, match=r"^leases/x/0000000001: "):
        p.decode_beat(p.beat_key("x", 1), json.dumps({**wire, "waited_s": float("nan")}).encode())


def test_waiting_fraction_and_stalling_on_the_observer_clock() -> None:
    now, clock = fake_clock()
    run = Run(gm.MemoryMailbox())
    run.create()
    watcher = RunWatcher(run.box, lease_timeout=60.0, clock=clock, wait_window=30.0)
    run.beat("slow", 1, sync_points=1, contributed=1, waited_s=10.0)
    run.beat("fast", 1, sync_points=1, contributed=1, waited_s=1.0)
    slow, fast = poll(watcher).learners[::-1]
    assert (slow.waiting_fraction, fast.waiting_fraction) == (None, None)  # one beat each

    now[0] += 10.0
    run.beat("slow", 2, sync_points=2, contributed=2, waited_s=16.0)  # 6 s of the last 10
    run.beat("fast", 2, sync_points=2, contributed=2, waited_s=1.2)  # 0.2 s of 10
    view = poll(watcher)
    fast, slow = view.learners
    assert slow.waiting_fraction == pytest.approx(0.6)
    assert fast.waiting_fraction == pytest.approx(0.02)
    assert (slow.stalling, fast.stalling) == (True, False)
    assert view.sync.stalling == ("slow",)
    assert view.sync.waited_s == pytest.approx(17.2)

    # The window slides: 40 s later, only the last 30 s or so count.
    for _ in range(4):
        now[0] += 10.0
        run.beat("slow", slow.beat + 1, sync_points=3, contributed=3, waited_s=16.5)
        slow = poll(watcher).learners[1]
    assert slow.waiting_fraction is not None
    assert slow.waiting_fraction < STALLING_FRACTION
    assert not slow.stalling

    # A counter that goes back (the learner restarted under its id) starts over.
    now[0] += 10.0
    run.beat("slow", slow.beat + 1, sync_points=1, contributed=1, waited_s=0.0)
    assert poll(watcher).learners[1].waiting_fraction is None

    # A learner that left is neither waiting nor stalling.
    run.beat("fast", p.LEAVING_BEAT, sync_points=3, contributed=3, waited_s=100.0)
    now[0] += 10.0
    fast = poll(watcher).learners[0]
    assert (fast.live, fast.waiting_fraction, fast.stalling) == (False, None, False)


# -- running totals: a first poll reads one commit record per fragment -------------------------


def _history(run: Run, first: int, last: int) -> None:
    """Training rounds ``first .. last - 1``, with changing contributors and samples."""
    for r in range(first, last):
        run.commit(r, {f"l{k}": 8 * (1 + (r + k) % 3) for k in range(1 + r % 3)})


def _numbers(view: RunView) -> tuple[object, ...]:
    return (
        view.rounds_committed,
        view.samples_committed,
        view.newest_round,
        dict(view.newest_per_fragment),
        view.last_contributors,
    )


def _metered(box: gm.Mailbox) -> tuple[RunWatcher, Counters]:
    counters = Counters()
    return RunWatcher(Metered(box, counters, threading.Lock())), counters


def _round_gets(counters: Counters) -> int:
    return counters.requests.get("get:rounds", 0)


def test_a_first_poll_reads_the_newest_commit_of_each_fragment() -> None:
    rounds = 400
    totalled, old = Run(gm.MemoryMailbox(), totals=True), Run(gm.MemoryMailbox())
    for run in (totalled, old):
        run.create()
        _history(run, P, P + rounds)
    samples = sum(
        sum(8 * (1 + (r + k) % 3) for k in range(1 + r % 3)) for r in range(P, P + rounds)
    )

    watcher, counters = _metered(totalled.box)
    fresh = poll(watcher)
    assert _round_gets(counters) == P  # the newest record of each fragment, not all 402
    assert counters.requests["list:rounds"] == 1
    assert (fresh.rounds_committed, fresh.samples_committed) == (rounds, samples // P)
    assert fresh.newest_round == P + rounds - 1
    assert fresh.newest_per_fragment == {0: P + rounds - 2, 1: P + rounds - 1}

    # The same view as counting every record (commits without totals: read one by one).
    everything, old_counters = _metered(old.box)
    assert _numbers(poll(everything)) == _numbers(fresh)
    assert _round_gets(old_counters) == P + rounds

    # Later polls: the newest new record of each fragment, however many landed.
    for run in (totalled, old):
        _history(run, P + rounds, P + rounds + 25)
    gets = _round_gets(counters)
    later = poll(watcher)
    assert _round_gets(counters) == gets + P
    assert _numbers(later) == _numbers(poll(everything))
    assert later.rounds_committed == rounds + 25
    assert _numbers(later) == _numbers(poll(_metered(totalled.box)[0]))  # and a fresh watcher

    # Nothing new: nothing read.
    gets = _round_gets(counters)
    assert _numbers(poll(watcher)) == _numbers(later)
    assert _round_gets(counters) == gets


def test_a_run_from_before_totals_is_counted_record_by_record() -> None:
    """Commits without totals (an earlier release's): every record is read, once, and a
    closer that starts writing totals (its base an initial commit) is taken at its word."""
    run = Run(gm.MemoryMailbox())
    run.create()
    _history(run, P, P + 7)
    watcher, counters = _metered(run.box)
    view = poll(watcher)
    assert _round_gets(counters) == P + 7
    assert view.rounds_committed == 7
    _history(run, P + 7, P + 10)
    view = poll(watcher)
    assert _round_gets(counters) == P + 10  # the 3 new ones, none twice
    assert view.rounds_committed == 10
    # One fragment's newest record carries totals, the other's does not.
    run.totals = True
    run.commit(P + 10, {"l9": 80})  # fragment 0
    run.totals = False
    run.commit(P + 11, {"l9": 80})  # fragment 1
    expected = _numbers(poll(watcher))
    fresh, fresh_counters = _metered(run.box)
    assert _numbers(poll(fresh)) == expected
    # Fragment 0: its newest record alone; fragment 1: all of its records.
    assert _round_gets(fresh_counters) == 1 + (P + 12) // 2
    assert expected[0] == 12
