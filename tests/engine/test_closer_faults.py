"""RoundCloser under faults: unusable snapshots are excluded, claims have a deadline, failover
watches survive other fragments, a lost record-write response is a win, and sweeping
catches up after a closer that never swept. An injected clock everywhere: no sleeps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.coord import retry as _retry
from gradientmail.coord.leases import LeaseTracker
from gradientmail.engine.closer import Outcome, RoundCloser
from gradientmail.engine.layout import ModelLayout
from gradientmail.engine.verify import verify_commit
from gradientmail.errors import MailboxUnavailable, ProtocolError
from gradientmail.events import Committed, Event
from gradientmail.payload import encode, put_tensors
from gradientmail.testing import FaultyMailbox

T = TypeVar("T")
Tensors = dict[str, torch.Tensor]
LEASE = 10.0
ROUND_TIMEOUT = 30.0  # where a test needs the claim deadline well apart from LEASE:
DEADLINE = ROUND_TIMEOUT + LEASE  # the default claim_timeout


def go(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def _no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_retry, "FIRST_DELAY", 0.0)  # retried calls go again at once


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Refusing(FaultyMailbox):
    """Raises (an error no retry absorbs) on ``gets`` reads under ``prefix``; -1: all."""

    def __init__(self, inner: gm.Mailbox, prefix: str, gets: int = -1) -> None:
        super().__init__(inner)
        self.prefix = prefix
        self.gets = gets

    async def get(self, key: str) -> bytes | None:
        if self.gets and key.startswith(self.prefix):
            self.gets -= 1
            raise RuntimeError(f"refused: {key}")
        return await super().get(key)


class LosesRecordResponse(FaultyMailbox):
    """The first write under ``rounds/`` reaches the store, and its response is lost."""

    def __init__(self, inner: gm.Mailbox) -> None:
        super().__init__(inner)
        self.lost = 0

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        won = await super().put_if_absent(key, data)
        if key.startswith(p.ROUNDS) and not self.lost:
            self.lost += 1
            raise MailboxUnavailable(f"injected: the response to writing {key} was lost")
        return won


class Run:
    """A run in one memory mailbox: its manifest and initial commits, learners' snapshots,
    closers on an injected clock, and trackers that see chosen learners beat."""

    def __init__(self, fragments: int = 1) -> None:
        torch.manual_seed(0)
        self.algorithm = gm.DiLoCo(
            sync_every=2, fragments=fragments, outer_lr=0.7, outer_momentum=0.9
        )
        model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
        self.layout = ModelLayout(model, self.algorithm)
        assert self.layout.count == fragments
        self.store = gm.MemoryMailbox()
        self.clock = Clock()
        self.events: list[Event] = []
        self.manifest = self.layout.manifest("creator", self.algorithm)
        go(self.store.put_if_absent(p.MANIFEST, p.encode(self.manifest)))
        self.params: dict[int, Tensors] = {}  # committed parameters per round
        for f in range(fragments):
            initial = {n: model.get_parameter(n).detach().clone() for n in self.layout.fragments[f]}
            key = go(put_tensors(self.store, initial))[0]
            commit = p.Commit(f, f, None, (), key, None, "creator", 0)
            assert go(self.store.put_if_absent(p.round_key(f), p.encode(commit)))
            self.params[f] = initial
        self._beats = 0

    def tracker(self, *live: str) -> LeaseTracker:
        tracker = LeaseTracker(LEASE, clock=self.clock)
        self.beat(tracker, *live)
        return tracker

    def beat(self, tracker: LeaseTracker, *learners: str) -> None:
        """``tracker`` sees a new beat of each of ``learners`` now."""
        self._beats += 1
        tracker.observe([p.beat_key(x, self._beats) for x in learners])

    def closer(
        self, learner: str, tracker: LeaseTracker, box: gm.Mailbox | None = None, **kw: Any
    ) -> RoundCloser:
        settings: dict[str, Any] = {
            "quorum_size": 1,
            "round_timeout": 0.0,
            "keep_rounds": 100,
        }
        settings.update(kw)
        return RoundCloser(
            box or self.store,
            self.layout,
            self.algorithm,
            learner,
            tracker,
            emit=self.events.append,
            clock=self.clock,
            **settings,
        )

    def publish(
        self, r: int, learner: str, *, payload: str | None = None, record: bytes | None = None
    ) -> tuple[str, Tensors]:
        """``learner``'s snapshot of round ``r`` (its payload key, or a record, overridden)."""
        base = self.params[r - self.layout.count]
        local = {k: v + 0.01 * torch.randn(v.shape) for k, v in base.items()}
        key = go(put_tensors(self.store, local))[0] if payload is None else payload
        if record is None:
            record = p.encode(p.Snapshot(r, learner, 3, key, r - self.layout.count))
        assert go(self.store.put_if_absent(p.snapshot_key(r, learner), record))
        return key, local

    def close(self, closer: RoundCloser, r: int, own: tuple[str, Tensors]) -> Outcome | None:
        outcome = go(closer.try_close(r, own[0], own[1], None))
        if outcome is not None and outcome.params is not None:
            self.params[r] = outcome.params
        return outcome

    def keys(self, prefix: str = "") -> set[str]:
        return set(go(self.store.list(prefix)))


# -- exclusion -----------------------------------------------------------------------------


def _corrupt(run: Run) -> dict[str, Any]:
    """A payload whose bytes do not hash to its key (one byte flipped)."""
    local = {k: torch.randn(v.shape) for k, v in run.params[0].items()}
    key, data = encode(local)
    broken = bytearray(data)
    broken[-1] ^= 0xFF
    assert go(run.store.put_if_absent(key, bytes(broken)))
    return {"payload": key}


UNUSABLE = {
    "corrupt payload": (_corrupt, "PayloadCorrupt"),
    "missing payload": (lambda run: {"payload": p.blob_key("1" * 64)}, "missing"),
    "truncated record": (lambda run: {"record": b'{"round": 1, "lear'}, "not valid JSON"),
    "record of another learner": (
        lambda run: {"record": p.encode(p.Snapshot(1, "a", 3, p.blob_key("2" * 64), 0))},
        "names learner 'a'",
    ),
}


@pytest.mark.parametrize("fault", sorted(UNUSABLE))
def test_an_unusable_snapshot_is_excluded_and_the_round_commits_without_it(fault: str) -> None:
    run = Run()
    make, reason = UNUSABLE[fault]
    own = run.publish(1, "a")
    run.publish(1, "b", **make(run))
    outcome = run.close(run.closer("a", run.tracker("a", "b")), 1, own)
    assert outcome is not None
    assert outcome.params is not None
    commit = outcome.commit
    assert [c.learner for c in commit.contributors] == ["a"]
    assert [(x.learner, x.key) for x in commit.excluded] == [("b", p.snapshot_key(1, "b"))]
    assert reason in commit.excluded[0].reason
    # The record lists it; a reader gets it back; anyone can recompute the commit.
    stored = go(run.store.get(p.round_key(1)))
    assert json.loads(stored or b"")["excluded"][0]["learner"] == "b"
    assert p.decode_commit(p.round_key(1), stored) == commit
    verified = go(verify_commit(run.store, 1, run.manifest))
    assert verified.contributors == ("a",)
    assert verified.excluded == ("b",)
    event = run.events[-1]
    assert isinstance(event, Committed)
    assert not event.adopted
    assert event.excluded == ("b",)
    # The next round builds on it as on any other.
    own = run.publish(2, "a")
    run.publish(2, "b")
    assert run.close(run.closer("a", run.tracker("a", "b")), 2, own) is not None
    assert go(verify_commit(run.store, 2, run.manifest)).contributors == ("a", "b")


def test_the_excluded_field_is_written_only_when_not_empty() -> None:
    """Records without exclusions are byte-identical to before; old records decode."""
    plain = p.Commit(3, 0, 2, (), p.blob_key("3" * 64), None, "a", 0)
    wire = json.loads(p.encode(plain))
    assert "excluded" not in wire
    assert p.decode_commit(p.round_key(3), p.encode(plain)).excluded == ()
    marked = p.Commit(
        3, 0, 2, (), p.blob_key("3" * 64), None, "a", 0, excluded=(p.Exclusion("b", "k", "why"),)
    )
    assert p.decode_commit(p.round_key(3), p.encode(marked)) == marked
    wire["excluded"] = [{"learner": "b", "key": "k"}]
    with pytest.raises(ProtocolError, match="reason"):
        p.decode_commit(p.round_key(3), json.dumps(wire).encode())


def test_with_nothing_usable_the_close_fails() -> None:
    run = Run()
    own = run.publish(1, "a", **_corrupt(run))
    with pytest.raises(ProtocolError, match="no usable snapshot"):
        run.close(run.closer("a", run.tracker("a")), 1, ("", own[1]))


# -- the claim deadline ----------------------------------------------------------------------


def test_a_live_but_failing_closer_is_replaced_after_the_deadline() -> None:
    run = Run()
    own_a = run.publish(1, "a")
    own_b = run.publish(1, "b")
    seen_by_a, seen_by_b = run.tracker("a", "b"), run.tracker("a", "b")
    # Both contributed and are live: the round_timeout does not hold the close back.
    a = run.closer("a", seen_by_a, Refusing(run.store, p.BLOBS), round_timeout=ROUND_TIMEOUT)
    b = run.closer("b", seen_by_b, round_timeout=ROUND_TIMEOUT)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="refused"):
            run.close(a, 1, own_a)
        assert run.close(b, 1, own_b) is None  # a is live and within its deadline
        run.clock.now += 1
    # a gave its attempt up: no more retries (nor RoundFailed) from it.
    assert run.close(a, 1, own_a) is None
    run.clock.now = DEADLINE - 1
    run.beat(seen_by_b, "a", "b")
    run.beat(seen_by_a, "a", "b")
    assert run.close(b, 1, own_b) is None  # a still live, the deadline not reached
    run.clock.now = DEADLINE + 1
    run.beat(seen_by_b, "a", "b")
    run.beat(seen_by_a, "a", "b")
    assert run.close(a, 1, own_a) is None  # a waits a lease longer: b may take over first
    outcome = run.close(b, 1, own_b)
    assert outcome is not None
    assert outcome.params is not None
    assert (outcome.commit.closer, outcome.commit.attempt) == ("b", 1)
    assert [c.learner for c in outcome.commit.contributors] == ["a", "b"]
    assert run.keys(p.claims_prefix(1)) == {p.claim_key(1, 0), p.claim_key(1, 1)}
    go(verify_commit(run.store, 1, run.manifest))


def test_a_closer_alone_that_keeps_failing_retries_as_the_next_attempt() -> None:
    """Its own claim is given up after a few failures; past the deadline it claims the next
    attempt itself (nobody else contributed), rather than hammer the failing one."""
    run = Run()
    own = run.publish(1, "a")
    a = run.closer(
        "a", run.tracker("a"), Refusing(run.store, p.BLOBS, gets=3), round_timeout=ROUND_TIMEOUT
    )
    for _ in range(3):
        with pytest.raises(RuntimeError, match="refused"):
            run.close(a, 1, own)
    assert run.close(a, 1, own) is None  # the store works again, but attempt 0 was given up
    run.clock.now = DEADLINE
    outcome = run.close(a, 1, own)
    assert outcome is not None
    assert outcome.commit.attempt == 1


# -- failover watches per round --------------------------------------------------------------


def test_a_failover_watch_survives_another_fragment_running_far_ahead() -> None:
    """Fragment 0's round 2 is claimed by ``a``, who died; ``b`` watches the claim. Fragment
    1 running far ahead (round 13 > 2 + 4 * P) must not restart that watch."""
    run = Run(fragments=2)
    run.publish(2, "a")
    own = run.publish(2, "b")
    assert go(run.store.put_if_absent(p.claim_key(2, 0), p.encode(p.Claim("a"))))
    seen_by_b = run.tracker("b")  # a is not live
    b = run.closer("b", seen_by_b)
    assert run.close(b, 2, own) is None  # watching a's claim from now on
    for t in (3.0, 6.0, LEASE - 1):
        run.clock.now = t
        run.beat(seen_by_b, "b")
        assert go(b.try_close(13, "", {}, None)) is None  # fragment 1's round, far ahead
        assert run.close(b, 2, own) is None
    run.clock.now = LEASE + 1
    run.beat(seen_by_b, "b")
    go(b.try_close(13, "", {}, None))
    outcome = run.close(b, 2, own)
    assert outcome is not None
    assert (outcome.commit.closer, outcome.commit.attempt) == ("b", 1)


def test_round_timeout_is_not_restarted_by_another_fragment_running_far_ahead() -> None:
    run = Run(fragments=2)
    own = run.publish(2, "b")  # c is live but does not contribute: quorum + round_timeout
    seen_by_b = run.tracker("b", "c")
    b = run.closer("b", seen_by_b, round_timeout=5.0)
    assert run.close(b, 2, own) is None
    for t in (2.0, 4.0, 6.0):
        run.clock.now = t
        run.beat(seen_by_b, "b", "c")
        go(b.try_close(13, "", {}, None))
    outcome = run.close(b, 2, own)
    assert outcome is not None
    assert outcome.commit.round == 2


def test_only_forget_or_a_later_round_of_the_same_fragment_drops_a_watch() -> None:
    run = Run(fragments=2)
    b = run.closer("b", run.tracker("b", "c"))
    for r in (2, 3):
        go(b.try_close(r, "", {}, None))
    b.forget(3)  # the session saw round 3 committed
    go(b.try_close(13, "", {}, None))  # another fragment, far ahead: 2 stays
    assert sorted(b._watch) == [2, 13]
    go(b.try_close(6, "", {}, None))  # 6 builds on 4, which built on 2: 2 is committed
    assert sorted(b._watch) == [6, 13]


# -- lost responses and sweeping -------------------------------------------------------------


def test_a_lost_response_on_the_record_write_is_a_win_and_the_round_is_swept() -> None:
    run = Run()
    box = LosesRecordResponse(run.store)
    a = run.closer("a", run.tracker("a", "b"), box, keep_rounds=1)
    for r in (1, 2):
        own = run.publish(r, "a")
        run.publish(r, "b")
        outcome = run.close(a, r, own)
        assert outcome is not None
        assert box.lost == 1  # round 1's record response was lost: the retry found it taken
        event = run.events[-1]
        assert isinstance(event, Committed)
        assert event.round == r
        assert not event.adopted  # our own record: won, not adopted
        assert outcome.params is not None
        assert outcome.commit.closer == "a"
        go(a.sweep(outcome.commit))  # as the session does for a round it won
    assert not run.keys(p.snapshots_prefix(1))
    assert not run.keys(p.claims_prefix(1))


def test_a_losing_closer_adopts_the_record_and_deletes_the_payloads_it_uploaded() -> None:
    run = Run()
    own = run.publish(1, "a")
    run.publish(1, "b")
    # b took over from a (attempt 1) and committed with b's snapshot alone.
    assert go(run.store.put_if_absent(p.claim_key(1, 0), p.encode(p.Claim("a"))))
    b = run.closer("b", run.tracker("b"), quorum_size=1)
    theirs = go(b._close(1, 1, [p.snapshot_key(1, "b")], "", {}, None))
    a = run.closer("a", run.tracker("a", "b"))
    before = run.keys(p.BLOBS)
    outcome = run.close(a, 1, own)
    assert outcome is not None
    assert outcome.params is None
    assert outcome.commit == theirs.commit
    event = run.events[-1]
    assert isinstance(event, Committed)
    assert event.adopted
    assert run.keys(p.BLOBS) == before  # a's parameters and momentum are gone again
    go(verify_commit(run.store, 1, run.manifest))


def _objects(run: Run, r: int) -> set[str]:
    """What sweeping round ``r`` deletes: snapshots, claims, payloads and parameters."""
    found = run.keys(p.snapshots_prefix(r)) | run.keys(p.claims_prefix(r))
    for key in run.keys(p.snapshots_prefix(r)):
        found.add(p.decode_snapshot(key, go(run.store.get(key))).payload)
    commit = p.decode_commit(p.round_key(r), go(run.store.get(p.round_key(r))))
    return found | {commit.params, commit.momentum or commit.params}


def _close_round(run: Run, closer: RoundCloser, r: int) -> Outcome:
    own = run.publish(r, "a")
    run.publish(r, "b")
    outcome = run.close(closer, r, own)
    assert outcome is not None
    assert outcome.params is not None
    return outcome


def test_a_closer_killed_before_its_sweep_is_swept_up_by_the_next_commit() -> None:
    run = Run()
    a = run.closer("a", run.tracker("a", "b"), keep_rounds=2)
    leaked = {}
    for r in (1, 2, 3, 4):
        outcome = _close_round(run, a, r)
        leaked[r] = _objects(run, r)
        if r != 3:  # round 3's closer died before its sweep (which was round 1's)
            go(a.sweep(outcome.commit))
    present = run.keys()
    assert not leaked[1] & present  # swept by round 4's sweep, with round 2
    assert not leaked[2] & present
    assert leaked[3] <= present
    assert leaked[4] <= present
    go(a.sweep(outcome.commit))  # idempotent: nothing more goes
    assert run.keys() == present
    go(verify_commit(run.store, 4, run.manifest))


def test_a_sweep_catches_up_a_bounded_number_of_rounds_at_a_time() -> None:
    run = Run()
    a = run.closer("a", run.tracker("a", "b"), keep_rounds=1)
    leaked = {}
    for r in range(1, 13):  # nobody swept rounds 1 .. 10
        outcome = _close_round(run, a, r)
        leaked[r] = _objects(run, r)
    go(a.sweep(outcome.commit))  # round 11, and the 7 oldest leftovers
    present = run.keys()
    assert [r for r in leaked if leaked[r] & present] == [8, 9, 10, 12]
    go(a.sweep(_close_round(run, a, 13).commit))  # round 12, and the rest
    present = run.keys()
    assert [r for r in leaked if leaked[r] & present] == []
