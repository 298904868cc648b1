"""Moshpit group rounds (``gm.Moshpit``, ``engine/groups.py``): the grid, exact averaging
on a full grid, dropouts, failover of a dead group closer, verification, refusals.

Learners run as threads of this process, each with its own ``gm.Session`` on one shared
mailbox; every step is a sync point (``sync_every=1``) and, with the default
``overlap=0``, ``step()`` returns once the learner's group round is applied. Parameters
hold small integers, so every average here is exact in float32 and the results do not
depend on which learner closed which group.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms.moshpit import group_key, initial_index, next_index
from gradientmail.coord.leases import LeaseTracker
from gradientmail.engine.groups import GroupLost, GroupRounds
from gradientmail.engine.layout import ModelLayout
from gradientmail.engine.verify import verify_group
from gradientmail.events import Event, GroupMissed, Left, RoundFailed

pytestmark = pytest.mark.timeout(120)

FAST: dict[str, Any] = {"lease_timeout": 3.0, "poll_interval": 0.05, "idle_poll_interval": 0.2}


def _model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def _fill(model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)


def _value(model: torch.nn.Module) -> float:
    values = {float(v) for param in model.parameters() for v in param.detach().flatten()}
    assert len(values) == 1, f"parameters disagree within one model: {sorted(values)[:4]}"
    return values.pop()


def _run(
    box: gm.Mailbox,
    algorithm: gm.Moshpit,
    count: int,
    rounds: int,
    *,
    values: Sequence[float] | None = None,
    on_event: Callable[[Event], None] | None = None,
    before: Callable[[int, gm.Session], None] | None = None,
    leave: set[int] | frozenset[int] = frozenset(),
    rounds_for: dict[int, int] | None = None,
    box_for: Callable[[str], gm.Mailbox] | None = None,
    **session: Any,
) -> tuple[dict[int, float], dict[int, gm.events.Counters]]:
    """``count`` learners, joined together, each with its parameters set to ``values[k]``
    (default ``k``) for its grid slot ``k``, taking ``rounds`` steps: their final values
    and counters, by slot. Learners in ``leave`` (slots) join and leave (``close()``) before
    the others take their first step. ``rounds_for``: other step counts, by slot;
    ``box_for``: each learner's own view of the mailbox, by learner id (fault injection)."""
    values = list(range(count)) if values is None else list(values)
    sessions: dict[int, gm.Session] = {}
    models = {i: _model() for i in range(count)}
    errors: list[BaseException] = []
    joined = threading.Barrier(count, timeout=60)
    final: dict[int, float] = {}
    counters: dict[int, gm.events.Counters] = {}
    gone = threading.Barrier(len(leave) + 1, timeout=60) if leave else None

    def learner(i: int) -> None:
        try:
            s = gm.Session(
                models[i],
                algorithm=algorithm,
                mailbox=box if box_for is None else box_for(f"l{i:03d}"),
                learner_id=f"l{i:03d}",
                on_event=on_event,
                **{**FAST, "round_timeout": 30.0, **session},
            )
            sessions[i] = s
            joined.wait()
            # Slots go in join order: the learner's slot (its cell) names it from here on.
            assert s._exchange.groups is not None
            slot = s._exchange.groups.slot
            assert slot is not None
            i = slot
            _fill(s.model, values[i])
            if i in leave:
                s.close()
                assert gone is not None
                gone.wait()
                return
            if gone is not None and i == min(set(range(count)) - set(leave)):
                gone.wait()  # one of those who stay waits for the leaves to be written
            if before is not None:
                before(i, s)
            for _ in range(rounds if rounds_for is None else rounds_for.get(i, rounds)):
                s.step()
            final[i] = _value(s.model)
            counters[i] = s.counters()
            s.close()
        except BaseException as exc:
            errors.append(exc)
            joined.abort()

    threads = [threading.Thread(target=learner, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=100)
    assert not errors, errors
    return final, counters


# -- the grid ------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "d"), [(2, 2), (3, 3), (4, 2), (2, 5)])
def test_learners_that_met_are_apart_the_next_round(m: int, d: int) -> None:
    cells = [initial_index(slot, m, d) for slot in range(m**d)]
    assert len(set(cells)) == m**d  # a full grid: one learner per cell
    for t in range(1, 2 * d + 1):
        groups: dict[str, list[int]] = {}
        for i, cell in enumerate(cells):
            groups.setdefault(group_key(cell, t), []).append(i)
        assert all(len(members) == m for members in groups.values())
        after = [
            next_index(cell, t, [(f"{j}", cells[j]) for j in groups[group_key(cell, t)]], f"{i}", m)
            for i, cell in enumerate(cells)
        ]
        for members in groups.values():
            for a, b in itertools.combinations(members, 2):
                assert group_key(after[a], t + 1) != group_key(after[b], t + 1)
        cells = after


def test_learners_sharing_a_cell_are_spread_over_free_coordinates() -> None:
    # Slots past the grid wrap around: slots 0 and 4 of a 2x2 grid share cell (0, 0).
    assert initial_index(4, 2, 2) == initial_index(0, 2, 2) == (0, 0)
    members = [("a", (0, 0)), ("b", (0, 0)), ("c", (1, 0))]
    moved = {me: next_index(index, 1, members, me, 4) for me, index in members}
    assert moved["c"] == (1, 0)  # alone on its coordinate: it keeps it
    assert {moved["a"][0], moved["b"][0]} == {0, 2}  # the two share no coordinate now
    assert group_key(moved["a"], 2) != group_key(moved["b"], 2)


def test_settings_round_trip_and_bad_settings_are_named() -> None:
    algorithm = gm.Moshpit(sync_every=7, group_size=3, grid_dims=4)
    assert type(algorithm).from_settings(algorithm.settings()) == algorithm
    for bad, field in (
        ({"group_size": 1}, "group_size"),
        ({"grid_dims": 0}, "grid_dims"),
        ({"grid_dims": 9}, "grid_dims"),
        ({"sync_every": 0}, "sync_every"),
    ):
        with pytest.raises(ValueError, match=field):
            gm.Moshpit(**bad)


# -- rounds over a mailbox -----------------------------------------------------------------


@pytest.mark.parametrize(("m", "d"), [(2, 1), (2, 2), (2, 3), (3, 2)])
def test_a_full_grid_holds_the_exact_global_mean_after_d_rounds(m: int, d: int) -> None:
    n = m**d
    box = gm.MemoryMailbox()
    final, counters = _run(box, gm.Moshpit(sync_every=1, group_size=m, grid_dims=d), n, d)
    mean = sum(range(n)) / n
    if m & (m - 1) == 0:  # weights 1/m are exact in binary: so is every average
        assert final == dict.fromkeys(range(n), mean)
    else:  # weights of 1/3 round: equal to float32 precision
        assert final == pytest.approx(dict.fromkeys(range(n), mean), rel=1e-6)
    assert all(c.missed_groups == 0 and c.wait_timeouts == 0 for c in counters.values())
    # One record per group and round, each of m members.
    for t in range(1, d + 1):
        keys = asyncio.run(box.list(p.group_round_prefix(t)))
        assert len(keys) == n // m
        for key in keys:
            commit = p.decode_commit(key, asyncio.run(box.get(key)))
            assert len(commit.contributors) == m


def test_before_d_rounds_a_full_grid_is_not_averaged_yet() -> None:
    final, _ = _run(gm.MemoryMailbox(), gm.Moshpit(sync_every=1, group_size=2, grid_dims=2), 4, 1)
    # Round 1 averages along dimension 0: slots (0, 1) and (2, 3).
    assert final == {0: 0.5, 1: 0.5, 2: 2.5, 3: 2.5}


def test_a_partial_grid_closes_its_smaller_groups_without_waiting_for_the_timeout() -> None:
    # 6 learners on a 2x2x2 grid: the lines of slots 4 and 5 along dimension 1 have one
    # learner; round_timeout is far beyond the test's own bound, so only the expected
    # members (from the slots) can have closed those groups.
    box = gm.MemoryMailbox()
    final, counters = _run(
        box, gm.Moshpit(sync_every=1, group_size=2, grid_dims=3), 6, 3, round_timeout=3600.0
    )
    assert sum(final.values()) == pytest.approx(sum(range(6)))
    assert all(c.missed_groups == 0 for c in counters.values())
    sizes = sorted(
        len(p.decode_commit(k, asyncio.run(box.get(k))).contributors)
        for k in asyncio.run(box.list(p.group_round_prefix(2)))
    )
    assert sizes == [1, 1, 2, 2]


def test_dropouts_keep_the_global_mean(tmp_path: Path) -> None:
    # 8 learners on a 2x2x2 grid; learners 2 and 5 leave after joining, before any round.
    # Their groups close without them (their leases say they left: round_timeout is far
    # beyond the test's bound), every average is over the members present with equal
    # samples, so the sum over all eight, the two that left included, stays what it was.
    final, counters = _run(
        gm.FileMailbox(tmp_path),
        gm.Moshpit(sync_every=1, group_size=2, grid_dims=3),
        8,
        3,
        leave={2, 5},
        round_timeout=3600.0,
    )
    assert set(final) == {0, 1, 3, 4, 6, 7}
    assert sum(final.values()) + 2 + 5 == pytest.approx(sum(range(8)))
    assert all(c.missed_groups == 0 for c in counters.values())
    # The partners of the two that left were alone in their first groups.
    assert len(set(final.values())) > 1  # not everyone averaged: the grid has holes


def test_a_dead_group_closer_fails_over() -> None:
    # A claim on group x of round 1 by "ghost", whose only beat never advances (it died
    # after claiming): the members take the claim over once they watched it a lease period
    # and commit under attempt 1.
    box = gm.MemoryMailbox()
    algorithm = gm.Moshpit(sync_every=1, group_size=2, grid_dims=1)
    asyncio.run(box.put_if_absent(p.beat_key("ghost", 0), p.encode(p.Beat("ghost"))))
    asyncio.run(box.put_if_absent(p.group_claim_key(1, "x", 0), p.encode(p.Claim("ghost"))))
    final, counters = _run(box, algorithm, 2, 1, lease_timeout=1.0, round_timeout=3600.0)
    assert final == {0: 0.5, 1: 0.5}
    commit = p.decode_commit(
        p.group_round_key(1, "x"), asyncio.run(box.get(p.group_round_key(1, "x")))
    )
    assert commit.attempt == 1
    assert commit.closer in {"l000", "l001"}
    assert sum(c.closed for c in counters.values()) == 1


def test_group_commits_verify_and_a_wrong_one_is_named(tmp_path: Path) -> None:
    box = gm.FileMailbox(tmp_path)
    _run(box, gm.Moshpit(sync_every=1, group_size=2, grid_dims=2), 4, 2)
    keys = [k for t in (1, 2) for k in asyncio.run(box.list(p.group_round_prefix(t)))]
    assert len(keys) == 4
    for key in keys:
        verified = asyncio.run(verify_group(box, key))
        assert len(verified.contributors) == 2
    # A record that names a member's own payload instead of the average: found out.
    key = keys[0]
    commit = p.decode_commit(key, asyncio.run(box.get(key)))
    forged = p.Commit(
        round=commit.round,
        fragment=0,
        base=None,
        contributors=commit.contributors,
        params=commit.contributors[0].payload,
        momentum=None,
        closer=commit.closer,
        group=commit.group,
    )
    path = tmp_path / "objects" / key
    path.unlink()  # a forged record in place of the closer's (create-once put aside)
    path.write_bytes(p.encode(forged))
    with pytest.raises(gm.ProtocolError, match="not the average"):
        asyncio.run(verify_group(box, key))


def test_a_mixed_diloco_and_moshpit_join_is_refused() -> None:
    box = gm.MemoryMailbox()
    with gm.Session(
        _model(), algorithm=gm.DiLoCo(sync_every=1), mailbox=box, learner_id="a", **FAST
    ):
        with pytest.raises(gm.ProtocolError, match=r"moshpit|algorithm"):
            gm.Session(
                _model(),
                algorithm=gm.Moshpit(sync_every=1),
                mailbox=box,
                learner_id="b",
                **FAST,
            )
    box = gm.MemoryMailbox()
    with gm.Session(
        _model(), algorithm=gm.Moshpit(sync_every=1), mailbox=box, learner_id="a", **FAST
    ):
        with pytest.raises(gm.ProtocolError, match="group_size"):
            gm.Session(
                _model(),
                algorithm=gm.Moshpit(sync_every=1, group_size=3),
                mailbox=box,
                learner_id="b",
                **FAST,
            )


class _CorruptBlobs(gm.Mailbox):
    """A learner's view of the mailbox in which every payload it uploads once ``armed`` is
    set arrives damaged (one byte flipped in the middle): a disk or a proxy that corrupts."""

    def __init__(self, inner: gm.Mailbox, armed: threading.Event) -> None:
        self.inner = inner
        self.armed = armed

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.startswith(p.BLOBS) and data and self.armed.is_set():
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        await self.inner.delete(keys)


def test_a_corrupt_payload_wedges_no_learner() -> None:
    # Everything l001 uploads is damaged. Whoever closes their group, nobody waits for
    # ever: a damaged snapshot is excluded (its owner then misses the group), a damaged
    # group commit is reported and its members keep their own parameters.
    box = gm.MemoryMailbox()
    events: list[Event] = []
    armed = threading.Event()  # after the join: the initial commit is sound
    final, counters = _run(
        box,
        gm.Moshpit(sync_every=1, group_size=2, grid_dims=1),
        2,
        3,
        on_event=events.append,
        before=lambda i, s: armed.set(),
        box_for=lambda learner: _CorruptBlobs(box, armed) if learner == "l001" else box,
        round_timeout=3600.0,
        wait_timeout=3600.0,
    )
    assert set(final) == {0, 1}
    assert all(c.wait_timeouts == 0 for c in counters.values())
    failed = [e for e in events if isinstance(e, RoundFailed) and "cannot be loaded" in e.error]
    missed = [e for e in events if isinstance(e, GroupMissed)]
    assert failed or missed  # each round ended one way or the other
    records = [
        p.decode_commit(k, asyncio.run(box.get(k)))
        for t in (1, 2, 3)
        for k in asyncio.run(box.list(p.group_round_prefix(t)))
    ]
    assert all(r.excluded or r.closer == "l001" for r in records)


def test_a_late_learner_moves_on_and_catches_up() -> None:
    # Slot 1 steps only once slot 0 has left: its group of round 1 closed without it (by
    # round_timeout, on slot 0's side), so it keeps its parameters, and its next
    # contribution goes to round 2, where it is alone (slot 0 left) and closes at once.
    box = gm.MemoryMailbox()
    events: list[Event] = []
    left = threading.Event()

    def on_event(event: Event) -> None:
        events.append(event)
        if isinstance(event, Left):
            left.set()

    def late(i: int, s: gm.Session) -> None:
        if i == 1:
            assert left.wait(60)

    final, counters = _run(
        box,
        gm.Moshpit(sync_every=1, group_size=2, grid_dims=1),
        2,
        2,
        rounds_for={0: 1},
        on_event=on_event,
        before=late,
        round_timeout=0.5,
    )
    assert final == {0: 0.0, 1: 1.0}
    assert counters[1].missed_groups == 1
    missed = [e for e in events if isinstance(e, GroupMissed)]
    assert [(e.round, e.group) for e in missed] == [(1, "x")]
    second = p.decode_commit(
        p.group_round_key(2, "x"), asyncio.run(box.get(p.group_round_key(2, "x")))
    )
    assert [c.learner for c in second.contributors] == [missed[0].learner]


@pytest.mark.parametrize(("m", "d", "steps"), [(2, 1, 8), (2, 2, 10)])
def test_old_group_rounds_are_swept_and_the_newest_kept(m: int, d: int, steps: int) -> None:
    box = gm.MemoryMailbox()
    _run(box, gm.Moshpit(sync_every=1, group_size=m, grid_dims=d), m**d, steps, keep_rounds=2)
    rounds = sorted({p.group_round_of(k) or 0 for k in asyncio.run(box.list("group-"))})
    # steps - keep_rounds - grid_dims - 1 and older are gone: the rounds that learners up
    # to grid_dims rounds behind may still have open are kept.
    assert rounds == list(range(steps - 2 - d, steps + 1))
    named = {
        payload
        for t in rounds
        for k in asyncio.run(box.list(p.group_round_prefix(t)))
        for payload in _payloads(p.decode_commit(k, asyncio.run(box.get(k))))
    }
    named |= {
        p.decode_snapshot(k, asyncio.run(box.get(k))).payload
        for t in rounds
        for k in asyncio.run(box.list(p.group_snapshots_prefix(t)))
    }
    initial = p.decode_commit(p.round_key(0), asyncio.run(box.get(p.round_key(0))))
    blobs = set(asyncio.run(box.list(p.BLOBS)))
    assert blobs <= named | {initial.params}  # nothing old is left
    # Nothing kept was lost: learners that do not train between rounds send the bytes of
    # the commit before, under the same content-addressed key, and the sweep spares it.
    assert named <= blobs


def _payloads(commit: p.Commit) -> set[str]:
    return {commit.params, *(c.payload for c in commit.contributors)}


def test_a_late_joiner_and_align_start_from_the_newest_group_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    box = gm.MemoryMailbox()
    _run(box, gm.Moshpit(sync_every=1, group_size=2, grid_dims=2), 4, 1)
    # Round 1's two groups hold 0.5 and 2.5: the average of the two is 1.5.
    model = _model()
    with caplog.at_level("INFO", logger="gradientmail"):
        assert gm.align(model, mailbox=box) == {0: 1}
    assert _value(model) == 1.5
    assert "sample-weighted average of group round 1's 2 group commits" in caplog.text
    joiner = _model()
    with gm.Session(
        joiner,
        algorithm=gm.Moshpit(sync_every=1, group_size=2, grid_dims=2),
        mailbox=box,
        learner_id="late",
        **FAST,
    ) as s:
        assert _value(joiner) == 1.5
        assert s.rounds == (1,)
        assert s._exchange.groups is not None
        assert s._exchange.groups.slot == 4  # the next free slot


def test_align_loads_the_global_average_all_groups_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    box = gm.MemoryMailbox()
    _run(box, gm.Moshpit(sync_every=1, group_size=2, grid_dims=1), 2, 1)
    model = _model()
    with caplog.at_level("INFO", logger="gradientmail"):
        assert gm.align(model, mailbox=box) == {0: 1}
    assert _value(model) == 0.5
    assert "the global average" in caplog.text


def test_overlap_keeps_the_local_progress_made_since_the_snapshot() -> None:
    # overlap=1: the group's average is applied one step after the snapshot, rebased on
    # what the learner did meanwhile (here: nothing but the step count).
    final, counters = _run(
        gm.MemoryMailbox(), gm.Moshpit(sync_every=2, group_size=2, grid_dims=1), 2, 4, overlap=1
    )
    assert final == {0: 0.5, 1: 0.5}
    assert all(c.wait_timeouts == 0 and c.missed_groups == 0 for c in counters.values())


def test_the_moshpit_page_snippet_runs_as_printed() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "moshpit.md").read_text()
    section = page.split("# Moshpit: small groups instead of one closer\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block in docs/moshpit.md"
    built: dict[str, object] = {"gm": gm}
    exec(match.group(1), built)
    assert built["algorithm"] == gm.Moshpit(sync_every=100, group_size=4, grid_dims=2)


def test_a_learner_whose_round_was_swept_moves_on_to_the_newest_round() -> None:
    box = gm.MemoryMailbox()
    algorithm = gm.Moshpit(sync_every=1, group_size=2, grid_dims=1)
    groups = GroupRounds(
        box,
        ModelLayout(_model(), algorithm),
        algorithm,
        "a",
        LeaseTracker(3.0),
        round_timeout=3600.0,
        claim_timeout=3600.0,
        keep_rounds=2,
    )
    assert asyncio.run(groups.join()) == 0
    # Its snapshot of round 3 is not there any more: swept while it was behind.
    with pytest.raises(GroupLost, match="round 3 was swept"):
        asyncio.run(groups.try_close(3, "x", p.blob_key("0" * 64), {}))
    assert groups.missed
    assert groups.last_round == 3
    # Its next contribution goes to the newest round anyone published to.
    record = p.Snapshot(7, "b", 1, p.blob_key("1" * 64), 0, (1,))
    asyncio.run(box.put_if_absent(p.group_snapshot_key(7, "x", "b"), p.encode(record)))
    assert asyncio.run(groups.next_round()) == 7


def test_an_unreadable_group_record_wedges_no_member() -> None:
    # Round 1's record of group x is garbage (a truncated upload, a bad disk): create-once,
    # it will never read. Both members report it, keep their parameters and meet again in
    # round 2, instead of retrying round 1 until their waits give up.
    box = gm.MemoryMailbox()
    asyncio.run(box.put_if_absent(p.group_round_key(1, "x"), b'{"format": 1, "rou'))
    events: list[Event] = []
    final, counters = _run(
        box,
        gm.Moshpit(sync_every=1, group_size=2, grid_dims=1),
        2,
        2,
        on_event=events.append,
        round_timeout=3600.0,
        wait_timeout=3600.0,
    )
    assert final == {0: 0.5, 1: 0.5}  # round 2 averaged the values they kept
    assert all(c.missed_groups == 1 and c.wait_timeouts == 0 for c in counters.values())
    lost = [e for e in events if isinstance(e, RoundFailed) and "cannot be read" in e.error]
    assert {e.learner for e in lost} == {"l000", "l001"}
