"""The fault injectors themselves: they must fail exactly where they are told to."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

import gradientmail as gm
from gradientmail.testing import FaultyMailbox, Injection, SlowMailbox


def test_fail_before_does_not_reach_the_store() -> None:
    inner = gm.MemoryMailbox()
    faulty = FaultyMailbox(inner).fail_before("put_if_absent", 1)
    with pytest.raises(gm.MailboxUnavailable, match="before the store"):
        asyncio.run(faulty.put_if_absent("k", b"x"))
    assert asyncio.run(inner.get("k")) is None
    assert asyncio.run(faulty.put_if_absent("k", b"x")) is True


def test_lost_response_is_applied() -> None:
    inner = gm.MemoryMailbox()
    faulty = FaultyMailbox(inner).lose_response("delete", 2)
    asyncio.run(inner.put_if_absent("a", b"1"))
    asyncio.run(inner.put_if_absent("b", b"2"))
    asyncio.run(faulty.delete(["a"]))
    with pytest.raises(gm.MailboxUnavailable, match="lost its response"):
        asyncio.run(faulty.delete(["b"]))
    assert asyncio.run(inner.list("")) == []
    assert faulty.injected == [Injection("delete", 2, "lost", None)]
    assert faulty.calls["delete"] == 2


def test_random_faults_are_reproducible() -> None:
    def pattern(seed: int) -> list[int]:
        faulty = FaultyMailbox(gm.MemoryMailbox()).randomly(0.3, seed=seed)
        for i in range(50):
            with contextlib.suppress(gm.MailboxUnavailable):
                asyncio.run(faulty.get(f"k/{i}"))
        return [i.call for i in faulty.injected]

    assert pattern(7) == pattern(7)
    assert pattern(7) != pattern(8)
    assert 5 < len(pattern(7)) < 30


def test_bad_schedules_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown mailbox operation"):
        FaultyMailbox(gm.MemoryMailbox()).fail_before("post", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start at 1"):
        FaultyMailbox(gm.MemoryMailbox()).lose_response("get", 0)
    with pytest.raises(ValueError, match="rate"):
        FaultyMailbox(gm.MemoryMailbox()).randomly(1.5, seed=1)


def test_slow_mailbox_uses_the_injected_clock() -> None:
    waited: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waited.append(seconds)

    slow = SlowMailbox(gm.MemoryMailbox(), {"put_if_absent": 2.0, "list": 0.5}, sleep=fake_sleep)

    async def run() -> None:
        await slow.put_if_absent("k", b"x")
        await slow.get("k")
        await slow.list("")

    asyncio.run(run())
    assert waited == [2.0, 0.5]
