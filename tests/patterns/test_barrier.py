"""Barrier (spec 000): arrivals under barriers/{name}/, over every mailbox.

Timeouts run on an injected clock (no real waiting); the three-node scenario runs on the
real clock, because "within one poll_interval of the last arrival" is about real time.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterable, Sequence

import pytest

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.patterns.barrier import Barrier, arrival_key
from gradientmail.testing import FaultyMailbox
from tests.support.waiting import TEST_TIMEOUT, wait_until


class FakeClock:
    """Monotonic seconds that only move when someone sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class Listings(gm.Mailbox):
    """Pass-through that records the size of every listing under a prefix."""

    def __init__(self, inner: gm.Mailbox) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.puts: list[bool] = []

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        created = await self.inner.put_if_absent(key, data)
        self.puts.append(created)
        return created

    async def get(self, key: str) -> bytes | None:
        return await self.inner.get(key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        keys = await self.inner.list(prefix, after=after)
        self.sizes.append(len(keys))
        return keys

    async def delete(self, keys: Iterable[str]) -> None:
        await self.inner.delete(keys)


def _keys(box: gm.Mailbox, prefix: str = "") -> list[str]:
    return list(asyncio.run(box.list(prefix)))


def _barrier(box: gm.Mailbox, learner: str, clock: FakeClock | None = None) -> Barrier:
    if clock is None:
        return Barrier(mailbox=box, learner_id=learner, poll_interval=0.05)
    return Barrier(
        mailbox=box, learner_id=learner, poll_interval=1.0, clock=clock, sleep=clock.sleep
    )


def _in_thread(target: object, *args: object) -> tuple[threading.Thread, dict[str, object]]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = target(*args)  # type: ignore[operator]
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_three_nodes_pass_within_one_poll_interval_of_the_last(mailbox: gm.Mailbox) -> None:
    """Spec 000: A, B, C reach "start" at different times with parties=3.

    The order of arrivals is set by conditions, not by sleeps: B arrives once A has looked
    (and seen itself alone), C once A has seen two arrivals and B has looked. Each node
    passes at its first look that sees all three (the polling cadence, one look per
    poll_interval, is checked on a fake clock below)."""
    poll = 0.25
    names = ("A", "B", "C")
    boxes = {name: Listings(mailbox) for name in names}
    arrived: dict[str, float] = {}
    passed: dict[str, float] = {}
    opened: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    def node(name: str) -> None:
        barrier = Barrier(mailbox=boxes[name], learner_id=name, poll_interval=poll)
        arrived[name] = time.monotonic()
        try:
            opened[name] = barrier.wait("start", parties=3, timeout=TEST_TIMEOUT)
        except BaseException as exc:
            errors.append(exc)
        passed[name] = time.monotonic()

    threads = {name: threading.Thread(target=node, args=(name,)) for name in names}
    threads["A"].start()
    wait_until(lambda: boxes["A"].sizes, "A's first look")
    threads["B"].start()
    wait_until(lambda: 2 in boxes["A"].sizes and boxes["B"].sizes, "A to see B, and B to look")
    threads["C"].start()
    for thread in threads.values():
        thread.join(timeout=TEST_TIMEOUT + 10)
    assert not errors, errors
    assert opened == {name: ["A", "B", "C"] for name in names}
    last = arrived["C"]
    for name in ("A", "B"):
        assert passed[name] >= last, f"{name} passed before C arrived"
    # Everyone passes at the first look that sees the last arrival, and looks no more.
    for name in names:
        assert boxes[name].sizes.count(3) == 1, (name, boxes[name].sizes)
    # A's polls saw one key, then two, then three; B's two, then three; C listed three at once.
    assert boxes["A"].sizes[0] == 1
    assert 2 in boxes["A"].sizes
    assert boxes["A"].sizes[-1] == 3
    assert boxes["A"].sizes == sorted(boxes["A"].sizes)
    assert boxes["B"].sizes[0] == 2
    assert boxes["B"].sizes[-1] == 3
    assert boxes["C"].sizes == [3]
    assert _keys(mailbox, "barriers/") == [arrival_key("start", n) for n in ("A", "B", "C")]
    assert _keys(mailbox, "barriers/") == [
        "barriers/start/A",
        "barriers/start/B",
        "barriers/start/C",
    ]


def test_timeout_keeps_the_arrival_and_a_second_wait_resumes(mailbox: gm.Mailbox) -> None:
    clock = FakeClock()
    a = _barrier(mailbox, "a", clock)
    with pytest.raises(TimeoutError, match=r"barrier 'epoch-1': 1 of 2 parties arrived within 5 s"):
        a.wait("epoch-1", parties=2, timeout=5)
    assert 5.0 <= clock.now < 5.5
    assert max(clock.sleeps) <= 1.0  # polled every poll_interval until the deadline
    assert _keys(mailbox, "barriers/") == ["barriers/epoch-1/a"]
    # A node arriving late finds the arrival of the one that gave up, and passes at once.
    b_clock = FakeClock()
    assert _barrier(mailbox, "b", b_clock).wait("epoch-1", parties=2, timeout=5) == ["a", "b"]
    assert b_clock.sleeps == []
    # Waiting again resumes: counted once, and the barrier is open now.
    assert a.wait("epoch-1", parties=2, timeout=5) == ["a", "b"]
    assert _keys(mailbox, "barriers/") == ["barriers/epoch-1/a", "barriers/epoch-1/b"]


def test_a_second_wait_resumes_until_the_others_arrive(mailbox: gm.Mailbox) -> None:
    a = _barrier(mailbox, "a", FakeClock())
    with pytest.raises(TimeoutError):
        a.wait("x", parties=2, timeout=2)
    real_a = _barrier(mailbox, "a")
    thread, out = _in_thread(lambda: real_a.wait("x", parties=2, timeout=TEST_TIMEOUT))
    wait_until(lambda: len(_keys(mailbox, "barriers/x/")) == 1, "a's arrival")
    _barrier(mailbox, "b").wait("x", parties=2, timeout=TEST_TIMEOUT)
    thread.join(timeout=TEST_TIMEOUT)
    assert out == {"result": ["a", "b"]}


def test_calling_wait_twice_counts_the_node_once(mailbox: gm.Mailbox) -> None:
    clock = FakeClock()
    counted = Listings(mailbox)
    a = Barrier(mailbox=counted, learner_id="a", clock=clock, sleep=clock.sleep)
    assert a.wait("solo", parties=1) == ["a"]
    assert a.wait("solo", parties=1) == ["a"]
    assert counted.puts == [True, False]
    # Two waits of the same node never open a barrier for two.
    for _ in range(2):
        with pytest.raises(TimeoutError, match="1 of 2"):
            a.wait("pair", parties=2, timeout=3)
    assert _keys(mailbox, "barriers/") == ["barriers/pair/a", "barriers/solo/a"]


def test_a_late_arrival_passes_at_once(mailbox: gm.Mailbox) -> None:
    thread, out = _in_thread(
        lambda: _barrier(mailbox, "a").wait("start", parties=2, timeout=TEST_TIMEOUT)
    )
    assert _barrier(mailbox, "b").wait("start", parties=2, timeout=TEST_TIMEOUT) == ["a", "b"]
    thread.join(timeout=TEST_TIMEOUT)
    assert out == {"result": ["a", "b"]}
    clock = FakeClock()
    late = Listings(mailbox)
    c = Barrier(mailbox=late, learner_id="c", clock=clock, sleep=clock.sleep)
    assert c.wait("start", parties=2) == ["a", "b", "c"]  # at least parties: all it listed
    assert clock.sleeps == []
    assert late.sizes == [3]


def test_a_restarted_node_finds_its_arrival(mailbox: gm.Mailbox) -> None:
    with pytest.raises(TimeoutError):
        _barrier(mailbox, "a", FakeClock()).wait("start", parties=2, timeout=1)
    # The process restarts: a new Barrier object for the same learner.
    restarted = Listings(mailbox)
    thread, out = _in_thread(
        lambda: Barrier(mailbox=restarted, learner_id="a", poll_interval=0.05).wait(
            "start", parties=2, timeout=TEST_TIMEOUT
        )
    )
    wait_until(lambda: restarted.puts, "the restarted node's arrival")
    assert restarted.puts == [False]  # its own arrival was already there
    assert _barrier(mailbox, "b").wait("start", parties=2, timeout=TEST_TIMEOUT) == ["a", "b"]
    thread.join(timeout=TEST_TIMEOUT)
    assert out == {"result": ["a", "b"]}
    # Restarting after the barrier opened: it passes at once.
    clock = FakeClock()
    again = Barrier(mailbox=mailbox, learner_id="b", clock=clock, sleep=clock.sleep)
    assert again.wait("start", parties=2) == ["a", "b"]
    assert clock.sleeps == []
    assert _keys(mailbox, "barriers/") == ["barriers/start/a", "barriers/start/b"]


def test_transient_failures_are_retried_with_backoff(mailbox: gm.Mailbox) -> None:
    faulty = (
        FaultyMailbox(mailbox)
        .fail_before("put_if_absent", 1)
        .lose_response("put_if_absent", 2)  # stored, but the caller cannot know
        .fail_before("list", 1, 2)
    )
    clock = FakeClock()
    barrier = Barrier(mailbox=faulty, learner_id="a", clock=clock, sleep=clock.sleep)
    assert barrier.wait("start", parties=1, timeout=60) == ["a"]
    assert len(faulty.injected) == 4
    assert faulty.calls["put_if_absent"] == 3  # the third found its own earlier write
    # Jittered backoff per operation: each wait drawn below 0.5 s, then below 1.0 s (put,
    # then list), so at most 3 s of the fake clock passed.
    assert 0.0 <= clock.now <= 3.0
    assert _keys(mailbox, "barriers/") == ["barriers/start/a"]


def test_an_outage_longer_than_the_timeout_is_a_timeout(mailbox: gm.Mailbox) -> None:
    faulty = FaultyMailbox(mailbox).fail_before("list", *range(1, 1000))
    clock = FakeClock()
    barrier = Barrier(mailbox=faulty, learner_id="a", clock=clock, sleep=clock.sleep)
    with pytest.raises(TimeoutError, match="stayed unavailable") as caught:
        barrier.wait("start", parties=1, timeout=20)
    assert isinstance(caught.value.__cause__, gm.MailboxUnavailable)
    assert clock.now <= 20
    assert _keys(mailbox, "barriers/") == ["barriers/start/a"]  # the arrival is recorded


def test_other_errors_are_not_retried() -> None:
    class Misconfigured(Listings):
        async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
            raise gm.MailboxConfigError("no such bucket")

    box = Misconfigured(gm.MemoryMailbox())
    clock = FakeClock()
    barrier = Barrier(mailbox=box, learner_id="a", clock=clock, sleep=clock.sleep)
    with pytest.raises(gm.MailboxConfigError, match="no such bucket"):
        barrier.wait("start", parties=1)
    assert clock.sleeps == []


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        ({"name": ""}, ValueError, "must not be empty"),
        ({"name": "a/b"}, ValueError, "contains '/'"),
        ({"name": "."}, ValueError, "not a valid key segment"),
        ({"name": ".."}, ValueError, "not a valid key segment"),
        ({"name": "a\nb"}, ValueError, "control character"),
        ({"name": "a\udcff"}, ValueError, "not valid UTF-8"),
        ({"name": "x" * 1000}, ValueError, "fit in a mailbox key"),
        ({"name": 7}, TypeError, "must be a str"),
        ({"parties": 0}, ValueError, "parties must be an int >= 1"),
        ({"parties": -2}, ValueError, "parties"),
        ({"parties": True}, ValueError, "parties"),
        ({"parties": 1.5}, ValueError, "parties"),
        ({"timeout": 0}, ValueError, "timeout must be a positive number"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"timeout": math.nan}, ValueError, "timeout"),
        ({"timeout": math.inf}, ValueError, "timeout"),
        ({"timeout": "5"}, ValueError, "timeout"),
    ],
)
def test_bad_wait_arguments_fail_before_any_io(call: dict, error: type, message: str) -> None:
    box = FaultyMailbox(gm.MemoryMailbox())
    barrier = Barrier(mailbox=box, learner_id="a")
    arguments = {"name": "start", "parties": 2, "timeout": 10.0} | call
    name = arguments.pop("name")
    with pytest.raises(error, match=message):
        barrier.wait(name, **arguments)
    with pytest.raises(error, match=message):
        asyncio.run(barrier.wait_async(name, **arguments))
    assert sum(box.calls.values()) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"learner_id": "a/b"}, ValueError, "not a valid key segment"),
        ({"learner_id": ""}, ValueError, "not a valid key segment"),
        ({"learner_id": ".."}, ValueError, "not a valid key segment"),
        ({"poll_interval": 0}, ValueError, "poll_interval"),
        ({"poll_interval": -1.0}, ValueError, "poll_interval"),
        ({"mailbox": object()}, TypeError, "must implement gm.Mailbox"),
    ],
)
def test_bad_barrier_arguments(kwargs: dict, error: type, message: str) -> None:
    arguments = {"mailbox": gm.MemoryMailbox(), "learner_id": "a"} | kwargs
    with pytest.raises(error, match=message):
        Barrier(**arguments)


def test_wait_async_and_wait_from_inside_an_event_loop() -> None:
    box = gm.MemoryMailbox()

    async def both() -> list[list[str]]:
        a, b = _barrier(box, "a"), _barrier(box, "b")
        return list(
            await asyncio.gather(
                a.wait_async("start", parties=2, timeout=TEST_TIMEOUT),
                b.wait_async("start", parties=2, timeout=TEST_TIMEOUT),
            )
        )

    assert asyncio.run(both()) == [["a", "b"], ["a", "b"]]

    async def blocking_call() -> list[str]:
        return _barrier(box, "c").wait("start", parties=3, timeout=TEST_TIMEOUT)

    assert asyncio.run(blocking_call()) == ["a", "b", "c"]


def test_a_session_keeps_renewing_its_lease_while_waiting() -> None:
    from tests.training import make_model

    box = gm.MemoryMailbox()
    algorithm = gm.DiLoCo(sync_every=10, fragments=1)
    barrier = Barrier(mailbox=box, learner_id="a", poll_interval=0.05)
    with gm.Session(
        make_model(), algorithm=algorithm, mailbox=box, learner_id="a", lease_timeout=0.6
    ):

        def beat() -> int:
            return p.parse_beat_key(_keys(box, p.lease_prefix("a"))[-1])[1]

        before = beat()
        seen: list[int] = []

        def second_party() -> None:
            # Arrives only once "a" has beaten twice more while its training thread is
            # blocked in the wait below: without those beats the wait times out.
            seen.append(wait_until(lambda: beat() >= before + 2 and beat(), "two more beats"))
            _barrier(box, "b").wait("start", parties=2, timeout=TEST_TIMEOUT)

        helper = threading.Thread(target=second_party, daemon=True)
        helper.start()
        assert barrier.wait("start", parties=2, timeout=TEST_TIMEOUT) == ["a", "b"]
        helper.join(timeout=TEST_TIMEOUT)
        assert len(seen) == 1
        assert seen[0] >= before + 2
