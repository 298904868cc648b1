"""Session, DiLoCo and align: learners as threads in one process, over every mailbox."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.coord import retry as _retry
from gradientmail.payload import get_tensors
from gradientmail.testing import FaultyMailbox
from tests.support.waiting import wait_until
from tests.training import (
    LOCKSTEP,
    Learner,
    commits,
    failures,
    make_model,
    run_learners,
    sync_points,
    train,
    verify_all,
)

ALGORITHM = gm.DiLoCo(sync_every=10, fragments=2, outer_lr=0.7, outer_momentum=0.9)


def _keys(box: gm.Mailbox, prefix: str = "") -> list[str]:
    return list(asyncio.run(box.list(prefix)))


def test_two_learners_commit_verified_rounds(mailbox: gm.Mailbox) -> None:
    """Two learners that start together train in lockstep (LOCKSTEP: a round waits for
    every live learner, a live learner is never judged gone): every sync point of each is
    one round holding both, every step of each is counted once per fragment, and the
    counters agree with what the store holds, whatever the delays on a loaded machine."""
    steps, batch = 100, 16
    learners = [Learner("a", steps, seed=1), Learner("b", steps, seed=2)]
    run_learners(learners, mailbox, ALGORITHM, together=True, **LOCKSTEP)
    found = commits(mailbox)
    training = [c for c in found if c.round >= ALGORITHM.fragments]
    expected = sync_points(ALGORITHM, steps)
    assert len(training) == sum(expected.values()), [c.round for c in training]
    for commit in training:
        assert {x.learner for x in commit.contributors} == {"a", "b"}, commit
    for fragment in range(ALGORITHM.fragments):
        mine = [c for c in found if c.fragment == fragment]
        assert [c.round for c in mine] == list(
            range(fragment, mine[-1].round + 1, ALGORITHM.fragments)
        ), f"fragment {fragment} skipped a round: {[c.round for c in mine]}"
        # Every step of both learners went into exactly one commit of each fragment.
        assert sum(c.samples for c in mine if c in training) == len(learners) * steps * batch
        assert len([c for c in mine if c in training]) == expected[fragment]
    verified = verify_all(mailbox)
    assert sum(v.samples for v in verified) == sum(c.samples for c in training)
    for learner in learners:
        assert failures(learner) == [], f"{learner.name}: {failures(learner)}"
        assert learner.session is not None
        counters = learner.session.counters()
        # One contribution per sync point, each in a commit (none skipped or missed).
        assert counters.sync_points == len(training), counters
        assert counters.published == len(training), counters
        assert counters.skipped_syncs == 0, counters
        assert counters.bytes_up.get("blobs", 0) > 0
    assert sum(ln.session.counters().closed for ln in learners if ln.session) == len(training)
    # Snapshot copies and the closers' new parameters reuse released buffers (and every
    # commit above verified: none was written while still in use).
    assert all(ln.session and ln.session._training.snapshots.reused for ln in learners)
    assert any(ln.session and ln.session._exchange.closer._params_out.reused for ln in learners)


def test_every_node_starts_from_the_creators_parameters() -> None:
    box = gm.MemoryMailbox()
    first, second = make_model(seed=1), make_model(seed=2)
    assert not torch.equal(first[0].weight, second[0].weight)
    creator = gm.Session(first, algorithm=ALGORITHM, mailbox=box, learner_id="creator")
    joiner = gm.Session(second, algorithm=ALGORITHM, mailbox=box, learner_id="joiner")
    try:
        assert creator.creator
        assert not joiner.creator
        for a, b in zip(first.parameters(), second.parameters(), strict=True):
            assert torch.equal(a, b)
    finally:
        joiner.close()
        creator.close()


def test_late_joiner_starts_from_the_newest_commits() -> None:
    box = gm.MemoryMailbox()
    early = Learner("early", 400, seed=1, delay=0.003)
    # LOCKSTEP: once the late learner is live, every round waits for it.
    thread = threading.Thread(target=train, args=(early, box, ALGORITHM), kwargs=LOCKSTEP)
    thread.start()
    try:
        wait_until(lambda: len(commits(box)) >= 12, "rounds before the late joiner")
        before = {c.fragment: c.round for c in commits(box)}  # newest per fragment, in order
        late = Learner("late", 30, seed=2, model=make_model(seed=99))
        train(late, box, ALGORITHM, **LOCKSTEP)
        assert late.error is None, repr(late.error)
        # At join, the late model held the newest commit of each fragment (at least as new
        # as the newest seen just before it started), not the initial parameters.
        assert all(late.joined_rounds[f] >= r for f, r in before.items()), (before, late)
        assert min(late.joined_rounds) >= ALGORITHM.fragments
        # Every round after its first contribution, while it trained, held it.
        held = [c.round for c in commits(box) if "late" in {x.learner for x in c.contributors}]
        assert held, "the late learner contributed to no round"
        assert held == list(range(held[0], held[-1] + 1)), held
    finally:
        thread.join(timeout=120)
    assert early.error is None


def test_align_loads_the_newest_commits(mailbox: gm.Mailbox) -> None:
    run_learners([Learner("a", 30, seed=1)], mailbox, ALGORITHM)
    model = make_model(seed=123)
    rounds = gm.align(model, mailbox=mailbox)
    newest = {c.fragment: c for c in commits(mailbox)}
    assert rounds == {f: c.round for f, c in newest.items()}

    async def params(key: str) -> dict[str, torch.Tensor]:
        return await get_tensors(mailbox, key)

    for commit in newest.values():
        for name, value in asyncio.run(params(commit.params)).items():
            assert torch.equal(dict(model.named_parameters())[name], value)


def test_model_or_algorithm_mismatch_is_named_and_writes_nothing() -> None:
    box = gm.MemoryMailbox()
    with gm.Session(make_model(), algorithm=ALGORITHM, mailbox=box, learner_id="a"):
        before = _keys(box)
        with pytest.raises(gm.ProtocolError, match=r"0\.weight: run has torch\.float32\[16, 8\]"):
            gm.Session(make_model(width=32), algorithm=ALGORITHM, mailbox=box, learner_id="b")
        other = gm.DiLoCo(sync_every=7, fragments=2)
        with pytest.raises(gm.ProtocolError, match="sync_every: run has 10, this node has 7"):
            gm.Session(make_model(), algorithm=other, mailbox=box, learner_id="c")
        assert _keys(box) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learner_id": "a/b"}, "not a valid key segment"),
        ({"learner_id": ".."}, "not a valid key segment"),
        ({"learner_id": ""}, "not a valid key segment"),
        ({"quorum_size": 0}, "quorum_size"),
        ({"round_timeout": 0}, "round_timeout"),
        ({"lease_timeout": -1}, "lease_timeout"),
        ({"keep_rounds": 0}, "keep_rounds"),
    ],
)
def test_bad_arguments_fail_before_anything_is_written(kwargs: dict, message: str) -> None:
    box = gm.MemoryMailbox()
    with pytest.raises(ValueError, match=message):
        gm.Session(make_model(), algorithm=ALGORITHM, mailbox=box, **kwargs)
    assert _keys(box) == []


def test_bad_algorithm_settings() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        gm.DiLoCo(sync_every=0)
    with pytest.raises(ValueError, match="cannot exceed sync_every"):
        gm.DiLoCo(sync_every=2, fragments=3)
    with pytest.raises(ValueError, match="outer_momentum"):
        gm.DiLoCo(outer_momentum=1.0)
    with pytest.raises(ValueError, match="fewer than"):
        gm.Session(
            make_model(), algorithm=gm.DiLoCo(sync_every=8, fragments=8), mailbox=gm.MemoryMailbox()
        )


@pytest.mark.parametrize("samples", [0, -1, 1.5, True, "3"])
def test_step_rejects_bad_sample_counts(samples: object) -> None:
    box = gm.MemoryMailbox()
    with gm.Session(make_model(), algorithm=ALGORITHM, mailbox=box, learner_id="a") as s:
        before = _keys(box, "snapshots/")
        with pytest.raises(ValueError, match="samples must be an int >= 1"):
            s.step(samples=samples)  # type: ignore[arg-type]
        assert s.steps == 0
        assert _keys(box, "snapshots/") == before


@pytest.mark.parametrize(
    ("key", "data", "message"),
    [
        ("manifest.json", b"hello", "not valid JSON"),
        ("manifest.json", b'{"format": 99, "creator": "x"}', "format version 99"),
        ("claims/creator", b"<html>", "not written by GradientMail"),
    ],
)
def test_a_prefix_holding_something_else_is_refused(key: str, data: bytes, message: str) -> None:
    box = gm.MemoryMailbox()
    asyncio.run(box.put_if_absent(key, data))
    with pytest.raises(gm.ProtocolError, match=message):
        gm.Session(make_model(), algorithm=ALGORITHM, mailbox=box, learner_id="a")
    assert _keys(box) == [key]


def test_a_closer_that_never_commits_is_replaced() -> None:
    """A claimant whose lease lapses (here: it never had one) is succeeded by attempt 1."""
    box = gm.MemoryMailbox()
    algorithm = gm.DiLoCo(sync_every=4, fragments=1)
    ghost = p.encode(p.Claim("ghost"))
    asyncio.run(box.put_if_absent(p.claim_key(1, 0), ghost))
    learner = Learner("a", 8)
    run_learners([learner], box, algorithm, lease_timeout=0.5, round_timeout=0.1)
    first = next(c for c in commits(box) if c.round == 1)
    assert (first.closer, first.attempt) == ("a", 1)
    assert _keys(box, p.claims_prefix(1)) == [p.claim_key(1, 0), p.claim_key(1, 1)]
    verify_all(box)


def test_lost_responses_are_retried_without_protocol_errors(
    mailbox: gm.Mailbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each learner's store loses responses: planned ones (every fourth of the first calls
    of each operation, which every run of these learners makes) and 20 % at random. Every
    loss is retried: no failure reported, every round with both learners, every step in
    exactly one commit of each fragment, every commit verified."""
    monkeypatch.setattr(_retry, "FIRST_DELAY", 0.01)
    monkeypatch.setattr(_retry, "MAX_DELAY", 0.05)
    steps, batch = 100, 16
    # Calls every run makes, by operation: a put of the payload and of the snapshot per
    # contribution, at least two reads and one listing per round (the other's snapshot or
    # the commit, and its payload).
    rounds = sum(sync_points(ALGORITHM, steps).values())
    planned = {
        op: range(1, floor + 1, 4)
        for op, floor in (("put_if_absent", 2 * rounds), ("get", 2 * rounds), ("list", rounds))
    }
    faulty = []
    for n in range(2):
        box = FaultyMailbox(mailbox)
        for op, calls in planned.items():
            box.lose_response(op, *calls)
        faulty.append(box.randomly(0.2, seed=n))
    learners = [Learner("a", steps, seed=1), Learner("b", steps, seed=2)]
    start = threading.Barrier(len(learners))
    threads = [
        threading.Thread(target=train, args=(learner, box, ALGORITHM, None, start), kwargs=LOCKSTEP)
        for learner, box in zip(learners, faulty, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for learner, box in zip(learners, faulty, strict=True):
        assert learner.error is None, repr(learner.error)
        lost = {(i.op, i.call) for i in box.injected}
        for op, calls in planned.items():
            missing = [call for call in calls if (op, call) not in lost]
            assert not missing, f"{learner.name}: {op} calls {missing} were never made"
        assert failures(learner) == [], failures(learner)
    training = [c for c in commits(mailbox) if c.round >= ALGORITHM.fragments]
    assert len(training) == rounds
    for commit in training:
        assert {x.learner for x in commit.contributors} == {"a", "b"}, commit
    for fragment in range(ALGORITHM.fragments):
        samples = sum(c.samples for c in training if c.fragment == fragment)
        assert samples == len(learners) * steps * batch, fragment
    verify_all(mailbox)


def test_corrupted_payload_and_truncated_record_are_detected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A damaged newest commit is detected (hash, JSON) and reported; align (and a joiner)
    load the fragment's commit before it instead, and say which round they loaded."""
    box = gm.MemoryMailbox()
    run_learners([Learner("a", 12)], box, ALGORITHM)
    found = commits(box)
    newest = found[-1]
    previous = max(c.round for c in found if c.fragment == newest.fragment and c is not newest)
    # Damage the stored objects behind the store's back (create-once forbids it through the API).
    box._objects[newest.params] = box._objects[newest.params][:-1] + b"\x00"
    with caplog.at_level("WARNING", logger="gradientmail"):
        rounds = gm.align(make_model(), mailbox=box)
    assert rounds[newest.fragment] == previous
    assert "hash" in caplog.text or "PayloadCorrupt" in caplog.text or newest.params in caplog.text
    key = p.round_key(newest.round)
    box._objects[key] = box._objects[key][:20]
    caplog.clear()
    with caplog.at_level("WARNING", logger="gradientmail"):
        rounds = gm.align(make_model(), mailbox=box)
    assert rounds[newest.fragment] == previous
    assert f"{key}" in caplog.text
    assert "not valid JSON" in caplog.text
    # Nothing loadable left for that fragment: a clear error naming each failure.
    for c in found:
        if c.fragment == newest.fragment:
            k = p.round_key(c.round)
            box._objects[k] = box._objects[k][:20]
    with pytest.raises(gm.ProtocolError, match="none of its newest"):
        gm.align(make_model(), mailbox=box)


def test_close_waits_for_rounds_in_flight_and_leaves() -> None:
    box = gm.MemoryMailbox()
    learner = Learner("a", 12)
    run_learners([learner], box, ALGORITHM)
    published = {e.round for e in learner.session.events if isinstance(e, gm.events.Published)}
    committed = {c.round for c in commits(box)}
    assert published
    assert published <= committed
    assert _keys(box, p.lease_prefix("a"))[-1] == p.beat_key("a", p.LEAVING_BEAT)
    view = asyncio.run(gm.inspect.inspect_run(box))
    assert view.live_learners == 0
    kinds = {type(e).__name__ for e in learner.session.events}
    assert {"Joined", "Published", "Committed", "Applied", "Left"} <= kinds


def test_old_snapshots_and_payloads_are_swept() -> None:
    box = gm.MemoryMailbox()
    run_learners([Learner("a", 120)], box, ALGORITHM, keep_rounds=2, **LOCKSTEP)
    rounds = [c.round for c in commits(box)]
    # Every sync point was a round (no wait for one could time out), so the sweep had many.
    assert rounds[-1] == ALGORITHM.fragments - 1 + sum(sync_points(ALGORITHM, 120).values())
    snapshot_rounds = {p.parse_snapshot_key(k)[0] for k in _keys(box, "snapshots/")}
    assert min(snapshot_rounds) >= rounds[-1] - 3 * ALGORITHM.fragments
    # Payloads left: a few rounds' worth, not the whole history.
    assert len(_keys(box, "blobs/")) <= 3 * 3 * ALGORITHM.fragments + 2
    gm.align(make_model(), mailbox=box)  # the newest commits are intact


def test_keep_rounds_one_sweeps_everything_but_the_newest() -> None:
    box = gm.MemoryMailbox()
    run_learners([Learner("a", 120)], box, ALGORITHM, keep_rounds=1, **LOCKSTEP)
    newest = ALGORITHM.fragments - 1 + sum(sync_points(ALGORITHM, 120).values())
    assert commits(box)[-1].round == newest
    # Per fragment: the newest commit's params and momentum, and at most one open round.
    assert len(_keys(box, "blobs/")) <= 3 * ALGORITHM.fragments
    gm.align(make_model(), mailbox=box)


def test_each_round_is_closed_once() -> None:
    box = gm.MemoryMailbox()
    learners = [Learner("a", 100, seed=1), Learner("b", 100, seed=2)]
    run_learners(learners, box, ALGORITHM)
    closed = [
        e.round
        for learner in learners
        if learner.session is not None
        for e in learner.session.events
        if isinstance(e, gm.events.Committed)
    ]
    assert len(closed) == len(set(closed)), "a round was reported committed twice"
    training = {c.round for c in commits(box) if c.round >= ALGORITHM.fragments}
    assert set(closed) == training
    assert sum(ln.session.counters().closed for ln in learners if ln.session) == len(training)


def test_plain_averaging_settings_average_the_snapshots() -> None:
    """outer_lr=1, momentum=0: a commit is the sample-weighted mean of its contributors."""
    algorithm = gm.DiLoCo(sync_every=5, fragments=1, outer_lr=1.0, outer_momentum=0.0)
    base = {"w": torch.zeros(3)}
    local = [
        ("a", 1, {"w": torch.tensor([3.0, 0.0, 3.0])}),
        ("b", 2, {"w": torch.tensor([0.0, 3.0, 3.0])}),
    ]
    params, _ = algorithm.combine(base, None, local)
    assert torch.allclose(params["w"], torch.tensor([1.0, 2.0, 3.0]))
    nesterov = gm.DiLoCo(outer_lr=0.5, outer_momentum=0.9)
    new, m = nesterov.combine(base, {"w": torch.ones(3)}, local)
    delta = -torch.tensor([1.0, 2.0, 3.0])
    expected_m = 0.9 * torch.ones(3) + delta
    assert torch.allclose(m["w"], expected_m)
    assert torch.allclose(new["w"], -0.5 * (delta + 0.9 * expected_m))


def _combine_inputs(
    dtype: torch.dtype, seed: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[tuple[str, int, dict]]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w": (5, 7), "b": (7,), "s": ()}
    base = {k: torch.randn(shape, generator=gen).to(dtype) for k, shape in shapes.items()}
    momentum = {k: torch.randn(shape, generator=gen) * 0.1 for k, shape in shapes.items()}
    local = [
        (
            name,
            samples,
            {
                k: (v + 0.01 * torch.randn(v.shape, generator=gen)).to(dtype)
                for k, v in base.items()
            },
        )
        for name, samples in (("c", 3), ("a", 1), ("b", 7))
    ]
    return base, momentum, local


def _bits(t: torch.Tensor) -> bytes:
    return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _buffers(base: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    return (
        {k: torch.full(v.shape, float("nan")) for k, v in base.items()},  # garbage is overwritten
        {k: torch.full(v.shape, float("nan")) for k, v in base.items()},
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("first_round", [True, False])
def test_combine_into_out_buffers_is_bitwise_the_same(
    dtype: torch.dtype, nesterov: bool, first_round: bool
) -> None:
    algorithm = gm.DiLoCo(outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    base, momentum, local = _combine_inputs(dtype)
    old = None if first_round else momentum
    expect = algorithm.combine(base, old, local)
    out = _buffers(base)
    got = algorithm.combine(base, old, local, out=out)
    for want, have in zip(expect, got, strict=True):
        assert want.keys() == have.keys()
        for k in want:
            assert want[k].dtype == have[k].dtype
            assert _bits(want[k]) == _bits(have[k]), k
    for k in base:  # the outputs are the buffers (for float32 parameters; else converted)
        assert got[1][k] is out[1][k]
        if dtype == torch.float32:
            assert got[0][k] is out[0][k]
    if not first_round:  # the momentum may be updated in place: out[1] is the input itself
        inplace = {k: v.clone() for k, v in momentum.items()}
        params, m = algorithm.combine(base, inplace, local, out=(_buffers(base)[0], inplace))
        assert all(m[k] is inplace[k] for k in base)
        assert all(_bits(m[k]) == _bits(expect[1][k]) for k in base)
        assert all(_bits(params[k]) == _bits(expect[0][k]) for k in base)


def test_combine_out_buffers_are_validated() -> None:
    algorithm = gm.DiLoCo()
    base, momentum, local = _combine_inputs(torch.float32)

    def check(out: tuple[dict, dict], message: str) -> None:
        with pytest.raises(ValueError, match=message):
            algorithm.combine(base, momentum, local, out=out)

    params, moms = _buffers(base)
    check(({k: v for k, v in params.items() if k != "b"}, moms), r"out params.*missing \['b'\]")
    check((params, {**moms, "x": torch.zeros(1)}), r"out momentum.*unexpected \['x'\]")
    check(({**params, "w": torch.zeros(7, 5)}, moms), r"out params\['w'\] has shape \[7, 5\]")
    check((params, {**moms, "b": torch.zeros(7, dtype=torch.bfloat16)}), r"\['b'\] is torch.bf")
    check(({**params, "w": torch.zeros(7, 5).t()}, moms), r"\['w'\] is not contiguous")
    check(({**params, "w": base["w"]}, moms), r"out params\['w'\] shares memory with the par")
    check((params, {**moms, "b": local[1][2]["b"]}), r"out momentum\['b'\] shares memory with c")
    check(({**params, "b": moms["b"]}, moms), r"out.*\['b'\] and out.*\['b'\] share memory")
    # Part of the momentum input is not the momentum input: only the whole tensor may be.
    flat = torch.zeros(35 + 7)
    overlapping = {**momentum, "w": flat[:35].view(5, 7), "b": flat[35:]}
    with pytest.raises(ValueError, match=r"out momentum\['w'\] shares memory with the mom"):
        algorithm.combine(
            base, overlapping, local, out=(params, {**moms, "w": flat[7:].view(5, 7)})
        )
    with pytest.raises(ValueError, match="pair"):
        algorithm.combine(base, momentum, local, out=(params,))  # type: ignore[arg-type]
    assert all(torch.isnan(v).all() for v in [*params.values(), *moms.values()])  # untouched


def test_fragments_are_balanced_and_staggered() -> None:
    algorithm = gm.DiLoCo(sync_every=100, fragments=4)
    assert [algorithm.offset(f) for f in range(4)] == [25, 50, 75, 0]
    assert [algorithm.due_fragment(s) for s in (25, 50, 75, 100, 101)] == [0, 1, 2, 3, None]
    groups = algorithm.split([(f"p{i}", 10) for i in range(8)])
    assert groups == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"], ["p6", "p7"]]
    assert all(algorithm.split([("big", 1000)] + [(f"s{i}", 1) for i in range(3)]))


def test_the_syncer_looks_for_an_awaited_commit_at_most_an_eighth_of_its_wait_late() -> None:
    """Simulated schedule: from a publish at 0, look at 25 ms, then after an eighth of the time
    waited so far, never more than poll_interval apart. A commit landing at any moment is
    seen within max(25 ms, an eighth of its latency) — bounded by poll_interval."""
    from gradientmail.session._state import _poll_delay

    poll_interval = 0.5
    looks = [0.0]
    for _ in range(200):  # bounded: the schedule passes 30 s well within 200 looks
        looks.append(looks[-1] + _poll_delay(looks[-1], poll_interval))
    gaps = [b - a for a, b in itertools.pairwise(looks)]
    assert gaps[0] == pytest.approx(0.025)
    assert max(gaps) == pytest.approx(poll_interval)
    for landed in [0.01, 0.1, 0.3, 0.37, 0.38, 0.8, 2.0, 10.0]:
        seen = next(t for t in looks if t >= landed)
        assert seen - landed <= min(poll_interval, max(0.025, 0.125 * seen)) + 1e-9
    # A small poll_interval wins over the first look.
    assert _poll_delay(0.0, 0.01) == 0.01


def test_a_wake_raised_from_another_thread_ends_the_wait_at_once() -> None:
    """The hand-over from step() (or a commit) reaches the waiting loop without a polling
    slice: a wait of ten minutes ends when another thread raises the flag (the suite's
    timeout fails this test if it does not)."""
    from gradientmail.coord.threads import Wake

    wake = Wake()
    waiting = threading.Event()

    async def waiter() -> bool:
        await wake.wait(0.001)  # binds the loop, times out: not raised
        assert not wake.consume()
        waiting.set()
        await wake.wait(600)
        return wake.consume()

    raiser = threading.Thread(target=lambda: (waiting.wait(60), wake.set()))
    raiser.start()
    assert asyncio.run(waiter())
    raiser.join(timeout=60)
    wake.set()  # the loop is closed now: raising is still safe, and leaves the flag up
    assert wake.consume()
