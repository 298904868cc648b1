"""Retry backoff: jittered, capped at a few seconds, on an injected clock (no real waiting)."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading

import pytest

from gradientmail.coord import retry as _retry
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.errors import MailboxUnavailable


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


class Store:
    """An operation that fails while the store is down (until ``up_at`` on the fake clock,
    or for the first ``failures`` calls), recording when each call was made."""

    def __init__(self, clock: FakeClock, *, up_at: float = 0.0, failures: int = 0) -> None:
        self.clock = clock
        self.up_at = up_at
        self.failures = failures
        self.calls: list[float] = []

    async def __call__(self) -> str:
        self.calls.append(self.clock.now)
        if self.clock.now < self.up_at or len(self.calls) <= self.failures:
            raise MailboxUnavailable("down")
        return "ok"

    def waits(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.calls)]


def _run(failures: int = 0, up_at: float = 0.0, **options: object) -> Store:
    clock = FakeClock()
    store = Store(clock, up_at=up_at, failures=failures)
    result = asyncio.run(retrying(store, clock=clock, sleep=clock.sleep, **options))  # type: ignore[arg-type]
    assert result == "ok"
    return store


def test_two_retriers_with_different_seeds_wait_differently() -> None:
    one = _run(failures=12, rng=random.Random(1)).waits()
    two = _run(failures=12, rng=random.Random(2)).waits()
    assert len(one) == len(two) == 12
    assert all(abs(a - b) > 1e-6 for a, b in zip(one, two, strict=True)), (one, two)
    # The same seed draws the same waits: the random source is the only difference.
    assert _run(failures=12, rng=random.Random(1)).waits() == pytest.approx(one)


def test_default_retriers_do_not_move_in_lockstep() -> None:
    """Without an injected source, each retrier draws its own waits (the OS seeds them)."""
    runs = [_run(failures=8).waits() for _ in range(3)]
    for a, b in itertools.combinations(runs, 2):
        assert a != pytest.approx(b)


def test_each_wait_is_drawn_below_a_doubling_bound_and_the_cap() -> None:
    rng = random.Random(7)
    for n in range(40):
        bound = min(_retry.MAX_DELAY, _retry.FIRST_DELAY * 2**n)
        draws = [
            _retry.backoff(n, first=_retry.FIRST_DELAY, cap=_retry.MAX_DELAY, rng=rng)
            for _ in range(200)
        ]
        assert all(0.0 <= d <= bound for d in draws)
        # Full jitter: the draws spread over the whole interval, not one point in it.
        assert min(draws) < 0.1 * bound
        assert max(draws) > 0.9 * bound
    assert (
        _retry.backoff(10_000, first=0.5, cap=5.0, rng=rng) <= 5.0
    )  # no overflow after long outages


def test_the_cap_holds_through_a_long_outage() -> None:
    assert _retry.MAX_DELAY <= 5.0  # a few seconds, not 30
    store = _run(up_at=600.0, rng=random.Random(3))
    waits = store.waits()
    assert max(waits) <= _retry.MAX_DELAY + 1e-9
    assert len(waits) >= 600 / _retry.MAX_DELAY  # it kept retrying all along


@pytest.mark.parametrize("run", range(5))
def test_a_recovered_store_is_used_within_the_cap(run: int) -> None:
    """After a 32 s outage the next retry comes within 5 s (before: at 63.5 s, 31.5 s late).
    The default random source, as in production: the bound holds for every draw."""
    clock = FakeClock()
    store = Store(clock, up_at=32.0)
    assert asyncio.run(retrying(store, clock=clock, sleep=clock.sleep)) == "ok"
    assert 32.0 <= store.calls[-1] <= 32.0 + 5.0, store.calls


def test_the_deadline_ends_retrying_before_it_passes() -> None:
    clock = FakeClock()
    store = Store(clock, up_at=1e9)
    with pytest.raises(MailboxUnavailable):
        asyncio.run(retrying(store, clock=clock, sleep=clock.sleep, deadline=20.0))
    assert clock.now <= 20.0
    assert store.calls[-1] > 20.0 - _retry.MAX_DELAY  # it retried until the last wait that fit


def test_stop_is_honoured_while_waiting() -> None:
    clock = FakeClock()
    stop = threading.Event()
    store = Store(clock, up_at=1e9)

    async def sleep(seconds: float) -> None:
        clock.now += seconds
        if clock.now > 10:
            stop.set()

    with pytest.raises(Stopped):
        asyncio.run(retrying(store, clock=clock, sleep=sleep, stop=stop))
    assert clock.now <= 10 + 0.1 + 1e-9  # noticed within one 0.1 s slice


def test_other_errors_are_not_retried() -> None:
    calls = []

    async def broken() -> None:
        calls.append(1)
        raise ValueError("not transient")

    clock = FakeClock()
    with pytest.raises(ValueError, match="not transient"):
        asyncio.run(retrying(broken, clock=clock, sleep=clock.sleep))
    assert calls == [1]
    assert clock.now == 0.0
