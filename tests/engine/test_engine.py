"""The round engine's liveness and faithfulness, learner by learner (issue 14).

Each test here failed on 3ca4a9c: sync points skipped against a slow store, the tail of
training thrown away by close(), one bad record wedging every poll, staged commits growing
without bound, beats starved by a long transfer, one fragment's download holding back the
other. Learners are threads in this process over a MemoryMailbox and fault wrappers; waits
are bounded conditions, never sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Iterable, Sequence

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.errors import MailboxUnavailable
from gradientmail.events import PollFailed, SyncSkipped, SyncWaited
from gradientmail.testing import SlowMailbox
from tests.support.waiting import wait_until
from tests.training import commits, make_model

# idle_poll_interval: how soon a learner that awaits no commit of its own sees one another
# wrote (the library's default, 5 s, made each test that writes commits by hand wait 5 s a
# poll); as fast as poll_interval, so those tests wait for the condition, not the clock.
FAST = {
    "poll_interval": 0.02,
    "idle_poll_interval": 0.02,
    "round_timeout": 5.0,
    "lease_timeout": 3.0,
    "keep_rounds": 10_000,
}


def _batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(8, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * (1 + seed)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, step: int) -> None:
    x, y = _batch(seed, step)
    loss = ((model(x) - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _reference(
    initial: torch.nn.Module, algorithm: gm.DiLoCo, names: Sequence[str], steps: int
) -> list[torch.nn.Module]:
    """Exact DiLoCo in one process: every learner's copy, every sync point combined at once
    with the library's own combine, the tails contributed at the end as close() does."""
    from gradientmail.engine.layout import ModelLayout

    models = [copy.deepcopy(initial) for _ in names]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    layouts = [ModelLayout(m, algorithm) for m in models]
    P = layouts[0].count
    glob = [
        {n: layouts[0].params[n].detach().clone() for n in layouts[0].fragments[f]}
        for f in range(P)
    ]
    momentum: list[dict[str, torch.Tensor] | None] = [None] * P
    counted = [0] * P
    due = {algorithm.offset(f): f for f in range(P)}

    def sync(fragment: int, samples_now: int) -> None:
        samples = samples_now - counted[fragment]
        counted[fragment] = samples_now
        contributions = [
            (name, samples, layout.copy_out(fragment))
            for name, layout in zip(names, layouts, strict=True)
        ]
        new, momentum[fragment] = algorithm.combine(
            glob[fragment], momentum[fragment], contributions
        )
        glob[fragment] = new
        for layout in layouts:
            layout.load(fragment, new)

    for step in range(1, steps + 1):
        for i, (model, opt) in enumerate(zip(models, opts, strict=True)):
            _train_step(model, opt, i, step)
        fragment = due.get(step % algorithm.sync_every)
        if fragment is not None:
            sync(fragment, step * 8)
    for fragment in range(P):
        if counted[fragment] != steps * 8:
            sync(fragment, steps * 8)
    return models


def _learn(
    session: gm.Session, model: torch.nn.Module, seed: int, steps: int, errors: list[BaseException]
) -> None:
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(1, steps + 1):
            _train_step(model, opt, seed, step)
            session.step(samples=8)
        session.close()
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.parametrize("fragments", [1, 2])
def test_overlap_zero_is_exact_diloco_bitwise(fragments: int) -> None:
    """overlap=0 (the default): every sync point contributes, step() waits for the commit,
    close() contributes the tail; the run equals the in-process algorithm bit for bit."""
    algorithm = gm.DiLoCo(sync_every=6, fragments=fragments)
    box = gm.MemoryMailbox()
    names = ["a", "b", "c"]
    models = [make_model(seed=i) for i in range(len(names))]
    initial = copy.deepcopy(models[0])  # "a" creates the run: everyone starts from it
    sessions = [
        gm.Session(m, algorithm=algorithm, mailbox=box, learner_id=n, **FAST)  # type: ignore[arg-type]
        for n, m in zip(names, models, strict=True)
    ]
    steps = 20  # not a multiple of sync_every: close() has a tail to contribute
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_learn, args=(s, m, i, steps, errors))
        for i, (s, m) in enumerate(zip(sessions, models, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a learner is stuck"
    assert errors == []
    expected = _reference(initial, algorithm, names, steps)[0]
    aligned = make_model(seed=99)
    gm.align(aligned, mailbox=box)
    for (name, want), got in zip(expected.named_parameters(), aligned.parameters(), strict=True):
        assert torch.equal(want, got), f"{name} differs from the in-process DiLoCo"
    for session in sessions:
        c = session.counters()
        assert c.skipped_syncs == 0
        assert c.published == c.sync_points  # every sync point contributed
        assert c.wait_timeouts == 0
    # Every round had all three learners in it.
    training = [c for c in commits(box) if c.round >= fragments]
    assert training
    assert all(len(c.contributors) == 3 for c in training)


class _Wrapper(gm.Mailbox):
    """Forwards every call to ``inner``; a fault wrapper overrides the ones it changes."""

    def __init__(self, inner: gm.Mailbox) -> None:
        self.inner = inner

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        return await self.inner.put_if_absent(key, data)

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        await self.inner.delete(keys)


class _SlowPuts(_Wrapper):
    """Every put_if_absent takes ``delay`` seconds: fast steps against a slow store. While
    ``released`` is clear, puts do not go through at all (bounded by a minute)."""

    def __init__(self, inner: gm.Mailbox, delay: float) -> None:
        self.released = threading.Event()
        self.released.set()

        async def sleep(seconds: float) -> None:
            if not self.released.is_set():
                await asyncio.to_thread(self.released.wait, 60)
            await asyncio.sleep(seconds)

        super().__init__(SlowMailbox(inner, {"put_if_absent": delay}, sleep=sleep))


@pytest.mark.parametrize("overlap", [0, 3])
def test_fast_steps_against_a_slow_store_never_skip_a_sync_point(overlap: int) -> None:
    algorithm = gm.DiLoCo(sync_every=5, fragments=1)
    box = _SlowPuts(gm.MemoryMailbox(), 0.02)
    model = make_model()
    session = gm.Session(
        model, algorithm=algorithm, mailbox=box, learner_id="a", overlap=overlap, **FAST
    )  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # The first round's puts wait until training waits for it, so the store is slower than
    # the steps at least once, whatever the machine's load (a watcher thread lets them go).
    box.released.clear()

    def release_once_training_waits() -> None:
        try:
            wait_until(lambda: session._shared.waiting_since is not None, "training to wait")
        finally:
            box.released.set()

    watcher = threading.Thread(target=release_once_training_waits)
    watcher.start()
    for step in range(1, 61):  # microseconds per step; each round takes tens of ms
        _train_step(model, opt, 0, step)
        session.step(samples=8)
    session.close()
    watcher.join(timeout=60)
    c = session.counters()
    assert not [e for e in session.events if isinstance(e, SyncSkipped)]
    assert c.sync_points == 12
    assert c.published == 12
    assert c.skipped_syncs == 0
    assert c.waits >= 1
    assert any(isinstance(e, SyncWaited) for e in session.events)
    assert [x.round for x in commits(box.inner.inner)] == list(range(13))


def test_free_running_keeps_the_old_skip_and_reports_inner_steps() -> None:
    algorithm = gm.DiLoCo(sync_every=5, fragments=1)
    box = _BlockedBlobs(gm.MemoryMailbox())
    box.released.set()
    model = make_model()
    session = gm.Session(
        model, algorithm=algorithm, mailbox=box, learner_id="a", free_running=True, **FAST
    )  # type: ignore[arg-type]
    box.released.clear()  # the first contribution's upload hangs: its fragment stays busy
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 41):
        _train_step(model, opt, 0, step)
        session.step(samples=8)
    before = session.counters()
    box.released.set()
    session.close()
    c = session.counters()
    assert before.waits == 0, "free-running never waits in step()"
    assert before.sync_points == 8
    assert before.skipped_syncs == 7
    assert c.published + c.skipped_syncs == c.sync_points
    assert c.last_inner_steps == 35  # the tail contribution covered 35 steps


def test_close_contributes_the_steps_since_the_last_sync_point() -> None:
    algorithm = gm.DiLoCo(sync_every=10, fragments=2)
    box = gm.MemoryMailbox()
    model = make_model()
    session = gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="a", **FAST)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 14):  # sync points at 5 (fragment 0) and 10 (fragment 1); 3 after
        _train_step(model, opt, 0, step)
        session.step(samples=8)
    session.close()
    found = commits(box)
    samples = {f: sum(c.samples for c in found if c.fragment == f) for f in (0, 1)}
    assert samples == {0: 13 * 8, 1: 13 * 8}, "every step's samples reach every fragment"
    aligned = make_model(seed=5)
    gm.align(aligned, mailbox=box)
    for a, b in zip(aligned.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), "the aligned model is this learner's final model"


def test_sync_contributes_now_and_returns_with_the_commit_applied() -> None:
    algorithm = gm.DiLoCo(sync_every=100, fragments=2)
    box = gm.MemoryMailbox()
    model = make_model()
    with gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="a", **FAST) as session:  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(1, 8):
            _train_step(model, opt, 0, step)
            session.step(samples=8)
        rounds = session.sync()
        assert rounds == (2, 3)
        aligned = make_model(seed=5)
        gm.align(aligned, mailbox=box)
        for a, b in zip(aligned.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        assert session.sync() == (2, 3), "nothing new: nothing contributed"


def staged(session: gm.Session, fragment: int, r: int) -> None:
    """Wait until the syncer staged round ``r`` of ``fragment``, then apply it with one
    ``step()`` (what the training thread does). Stepping at every look, as before, reached
    the run's sync points (the first at step 5) after as many looks, and there this learner
    contributed and waited for rounds the test is not about."""
    wait_until(
        lambda: (ahead := session._shared.staged.get(fragment)) and ahead.commit.round >= r,
        f"fragment {fragment}'s round {r} staged",
    )
    session.step()
    assert session.rounds[fragment] == r, session.rounds


def _write_commit(box: gm.Mailbox, commit: p.Commit) -> None:
    asyncio.run(box.put_if_absent(p.round_key(commit.round), p.encode(commit)))


def test_a_malformed_round_record_is_reported_once_and_skipped() -> None:
    """A truncated record of fragment 0 must not stop fragment 1 (or later rounds of 0)."""
    algorithm = gm.DiLoCo(sync_every=10, fragments=2)
    box = gm.MemoryMailbox()
    writer = gm.Session(make_model(1), algorithm=algorithm, mailbox=box, learner_id="w", **FAST)  # type: ignore[arg-type]
    model = make_model(2)
    reader = gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="r", **FAST)  # type: ignore[arg-type]
    try:
        first = commits(box)[1]
        asyncio.run(box.put_if_absent(p.round_key(2), b'{"format": 1, "round": 2, "fra'))
        # A valid commit of fragment 1, built by hand from the writer's parameters.
        good = p.Commit(3, 1, 1, (p.Contribution("w", 5, first.params),), first.params, None, "w")
        _write_commit(box, good)

        staged(reader, 1, 3)
        # Several more polls pass over the bad record: it is reported once.
        polls = reader.counters().requests.get("list:rounds", 0)
        wait_until(lambda: reader.counters().requests.get("list:rounds", 0) > polls + 3, "polls")
        bad = [e for e in reader.events if isinstance(e, PollFailed) and "0000000002" in e.error]
        assert len(bad) == 1, [e for e in reader.events if isinstance(e, PollFailed)]
        assert reader.rounds[0] == 0
    finally:
        reader._abandon()
        writer._abandon()


def test_staged_commits_stay_bounded_when_step_is_not_called() -> None:
    """Evaluation, a barrier, a data stall: commits keep landing while step() is not
    called. At most one staged commit per fragment is held."""
    algorithm = gm.DiLoCo(sync_every=10, fragments=1)
    box = gm.MemoryMailbox()
    model = make_model()
    session = gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="idle", **FAST)  # type: ignore[arg-type]
    try:
        base = commits(box)[0]
        for r in range(1, 40):
            _write_commit(
                box,
                p.Commit(
                    r, 0, r - 1, (p.Contribution("x", 1, base.params),), base.params, None, "x"
                ),
            )
        wait_until(lambda: session._shared.known[0] == 39, "the syncer saw every commit")
        assert len(session._shared.staged) <= 1
        session.step()
        assert session.rounds == (39,)
    finally:
        session._abandon()


class _BlockedBlobs(_Wrapper):
    """Puts of payloads wait until ``released`` is set: a transfer longer than a lease."""

    def __init__(self, inner: gm.Mailbox) -> None:
        super().__init__(inner)
        self.released = threading.Event()
        self.blocked = threading.Event()

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        if key.startswith(p.BLOBS) and not self.released.is_set():
            self.blocked.set()
            while not self.released.is_set():
                await asyncio.sleep(0.01)
        return await self.inner.put_if_absent(key, data)


def test_beats_go_on_during_a_transfer_longer_than_the_lease() -> None:
    algorithm = gm.DiLoCo(sync_every=2, fragments=1)
    inner = gm.MemoryMailbox()
    box = _BlockedBlobs(inner)
    box.released.set()  # the join uploads the initial parameters unhindered
    model = make_model()
    session = gm.Session(
        model,
        algorithm=algorithm,
        mailbox=box,
        learner_id="a",
        overlap=5,  # type: ignore[arg-type]
        lease_timeout=0.3,
        poll_interval=0.02,
        round_timeout=5.0,
    )
    try:
        box.released.clear()
        session.step()
        session.step()  # due: the publish blocks
        wait_until(box.blocked.is_set, "the publish to start")

        def newest_beat() -> str:
            return asyncio.run(inner.list(p.lease_prefix("a")))[-1]

        first = newest_beat()
        # Beats keep being written while the transfer hangs (every lease_timeout / 3), so
        # the learner stays live; before, they waited for the transfer.
        wait_until(lambda: newest_beat() != first, "a new beat during the transfer")
        second = newest_beat()
        wait_until(lambda: newest_beat() != second, "another beat during the transfer")
        assert not box.released.is_set()
    finally:
        box.released.set()
        session._abandon()


class _FailingFragment(_Wrapper):
    """Downloads of one payload fail (not transiently) until ``healed`` is set."""

    def __init__(self, inner: gm.Mailbox) -> None:
        super().__init__(inner)
        self.poisoned: set[str] = set()
        self.healed = threading.Event()

    async def get(self, key: str) -> bytes | None:
        if key in self.poisoned and not self.healed.is_set():
            raise gm.ProtocolError(f"{key}: injected unreadable payload")
        return await self.inner.get(key)


def test_one_fragments_failed_download_does_not_hold_back_the_other() -> None:
    algorithm = gm.DiLoCo(sync_every=10, fragments=2)
    inner = gm.MemoryMailbox()
    writer = gm.Session(make_model(1), algorithm=algorithm, mailbox=inner, learner_id="w", **FAST)  # type: ignore[arg-type]
    box = _FailingFragment(inner)
    reader = gm.Session(make_model(2), algorithm=algorithm, mailbox=box, learner_id="r", **FAST)  # type: ignore[arg-type]
    try:
        f0, f1 = commits(inner)[:2]
        # Fragment 0's new parameters: other bytes (and so another key) than its first commit.
        from gradientmail.payload import get_tensors, put_tensors

        async def fresh_payload() -> str:
            values = await get_tensors(inner, f0.params, reader._layout.specs[0])
            key, _ = await put_tensors(inner, {n: t + 1 for n, t in values.items()})
            return key

        poisoned = asyncio.run(fresh_payload())
        box.poisoned.add(poisoned)
        _write_commit(
            inner, p.Commit(2, 0, 0, (p.Contribution("w", 1, f0.params),), poisoned, None, "w")
        )
        _write_commit(
            inner, p.Commit(3, 1, 1, (p.Contribution("w", 1, f1.params),), f1.params, None, "w")
        )

        staged(reader, 1, 3)
        assert reader.rounds[0] == 0
        box.healed.set()
        staged(reader, 0, 2)
    finally:
        reader._abandon()
        writer._abandon()


def test_a_round_this_learner_closes_is_applied_without_a_download() -> None:
    """The closer hands its new parameters over before anything else (a slow on_event
    included): nothing is stranded and nothing is downloaded again."""
    slow = threading.Event()

    def on_event(event: gm.events.Event) -> None:
        slow.wait(0.05)  # a slow callback on the background threads

    algorithm = gm.DiLoCo(sync_every=3, fragments=1)
    box = gm.MemoryMailbox()
    model = make_model()
    session = gm.Session(
        model, algorithm=algorithm, mailbox=box, learner_id="a", on_event=on_event, **FAST
    )  # type: ignore[arg-type]
    joined = session.counters().requests.get("get:blobs", 0)  # the initial parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 31):
        _train_step(model, opt, 0, step)
        session.step(samples=8)
    session.close()
    c = session.counters()
    assert c.closed == 10
    assert c.applied == 10
    assert c.requests.get("get:blobs", 0) == joined, c.requests


def test_exiting_with_an_error_leaves_without_contributing() -> None:
    algorithm = gm.DiLoCo(sync_every=10, fragments=1)
    box = gm.MemoryMailbox()
    model = make_model()
    session = gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="a", **FAST)  # type: ignore[arg-type]

    def fail() -> None:
        with session:
            session.step()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert [c.round for c in commits(box)] == [0]
    assert session.counters().published == 0


def test_bad_settings_fail_before_anything_is_written() -> None:
    box = gm.MemoryMailbox()
    for kwargs, word in (
        ({"overlap": -1}, "overlap"),
        ({"overlap": 1.5}, "overlap"),
        ({"mixing": 1.0}, "mixing"),
        ({"wait_timeout": 0}, "wait_timeout"),
        ({"free_running": "yes"}, "free_running"),
    ):
        with pytest.raises(ValueError, match=word):
            gm.Session(make_model(), algorithm=gm.DiLoCo(), mailbox=box, **kwargs)  # type: ignore[arg-type]
    assert asyncio.run(box.list("")) == []


def test_unavailable_store_during_a_wait_is_bounded() -> None:
    """A wait for a commit that cannot come (the store refuses every write after the join)
    gives up after wait_timeout, reports it, and training goes on."""

    class Down(_Wrapper):
        def __init__(self, inner: gm.Mailbox) -> None:
            super().__init__(inner)
            self.down = False

        async def put_if_absent(self, key: str, data: bytes) -> bool:
            if self.down:
                raise MailboxUnavailable("injected outage")
            return await self.inner.put_if_absent(key, data)

    box = Down(gm.MemoryMailbox())
    session = gm.Session(
        make_model(),
        algorithm=gm.DiLoCo(sync_every=1),
        mailbox=box,
        learner_id="a",
        wait_timeout=0.3,
        **FAST,
    )  # type: ignore[arg-type]
    try:
        box.down = True
        session.step()
        c = session.counters()
        assert c.wait_timeouts == 1
        assert any(isinstance(e, SyncWaited) and e.timed_out for e in session.events)
    finally:
        box.down = False
        session._abandon()


def test_a_stray_key_under_rounds_wedges_nothing() -> None:
    """A tool's temporary file or a console's folder marker under rounds/ is not a round:
    running learners skip it (reported once), joiners and align ignore it."""
    algorithm = gm.DiLoCo(sync_every=4, fragments=1)
    box = gm.MemoryMailbox()
    model = make_model()
    session = gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="a", **FAST)  # type: ignore[arg-type]
    asyncio.run(box.put_if_absent("rounds/0000000099.tmp", b"{}"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(1, 13):
        _train_step(model, opt, 0, step)
        session.step(samples=8)
    assert session.rounds == (3,)
    joiner = gm.Session(make_model(3), algorithm=algorithm, mailbox=box, learner_id="b", **FAST)  # type: ignore[arg-type]
    assert joiner.rounds == (3,)
    joiner._abandon()
    session.close()
    stray = [e for e in session.events if isinstance(e, PollFailed) and ".tmp" in e.error]
    assert len(stray) == 1
    gm.align(make_model(4), mailbox=box)


def test_an_unreadable_newest_commit_does_not_keep_joiners_out() -> None:
    """The newest record of a fragment is truncated: a joiner and align load the commit
    before it (reported), instead of failing every time."""
    algorithm = gm.DiLoCo(sync_every=4, fragments=1)
    box = gm.MemoryMailbox()
    model = make_model()
    with gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="a", **FAST) as session:  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(1, 9):
            _train_step(model, opt, 0, step)
            session.step(samples=8)
    assert [c.round for c in commits(box)] == [0, 1, 2]
    asyncio.run(box.put_if_absent(p.round_key(3), b'{"format": 1, "rou'))
    aligned = make_model(5)
    assert gm.align(aligned, mailbox=box) == {0: 2}
    joiner = gm.Session(make_model(6), algorithm=algorithm, mailbox=box, learner_id="b", **FAST)  # type: ignore[arg-type]
    try:
        assert joiner.rounds == (2,)
    finally:
        joiner._abandon()


def test_a_learner_joining_mid_run_starts_with_the_fragment_whose_round_is_next() -> None:
    """Rounds 0..4 exist (P = 2): the next round is 5, fragment 1's. A joiner's first sync
    point is fragment 1's, after sync_every / P steps, so it joins the round the others
    are in rather than waiting in another one for them (the two groups would each wait
    for the other until round_timeout, round after round)."""
    algorithm = gm.DiLoCo(sync_every=10, fragments=2)
    box = gm.MemoryMailbox()
    first = gm.Session(make_model(1), algorithm=algorithm, mailbox=box, learner_id="w", **FAST)  # type: ignore[arg-type]
    base = commits(box)
    for r in (2, 3, 4):
        prev = base[r % 2]
        _write_commit(
            box,
            p.Commit(
                r, r % 2, r - 2, (p.Contribution("w", 1, prev.params),), prev.params, None, "w"
            ),
        )
    first._abandon()
    joiner = gm.Session(
        make_model(2), algorithm=algorithm, mailbox=box, learner_id="j", free_running=True, **FAST
    )  # type: ignore[arg-type]
    try:
        assert joiner.rounds == (4, 3)
        for _ in range(5):
            joiner.step()
        pending = dict(joiner._shared.inflight)
        assert list(pending) == [1]
        assert pending[1].round == 5
    finally:
        joiner._abandon()


def test_a_wait_that_gave_up_is_not_repeated_at_every_step() -> None:
    """overlap > 0 and the store refuses every write: the wait at the overlap deadline gives
    up once; the steps until the fragment's next sync point do not wait again."""

    class Down(_Wrapper):
        down = False

        async def put_if_absent(self, key: str, data: bytes) -> bool:
            if self.down:
                raise MailboxUnavailable("injected outage")
            return await self.inner.put_if_absent(key, data)

    box = Down(gm.MemoryMailbox())
    algorithm = gm.DiLoCo(sync_every=10)
    session = gm.Session(
        make_model(),
        algorithm=algorithm,
        mailbox=box,
        learner_id="a",
        overlap=2,
        wait_timeout=0.2,
        **FAST,
    )  # type: ignore[arg-type]
    try:
        box.down = True
        for _ in range(19):  # the sync point at 10, its overlap deadline at 12, then 7 more
            session.step()
        assert session.counters().wait_timeouts == 1
    finally:
        box.down = False
        session._abandon()
