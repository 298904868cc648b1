"""The claim-with-failover loop (coord/claims.py) and adopting a winning record
(engine/adopt.py), on an injected clock: nothing waits for real time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial

import pytest

from gradientmail import wire as p
from gradientmail.coord.claims import (
    HOLD,
    MAX_ATTEMPT,
    ClaimSeries,
    Verdict,
    closer_claims,
    judged,
)
from gradientmail.coord.leases import LeaseTracker
from gradientmail.engine.adopt import write_or_adopt
from gradientmail.errors import ProtocolError
from gradientmail.mailbox.memory import MemoryMailbox

LEASE = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def series(box: MemoryMailbox, me: str, clock: Clock) -> ClaimSeries:
    return closer_claims(box, me, partial(p.claim_key, 7), what="round 7", clock=clock)


async def newest(box: MemoryMailbox) -> int | None:
    keys = await box.list(p.claims_prefix(7))
    return p.parse_claim_attempt(keys[-1]) if keys else None


def decider(
    me: str, tracker: LeaseTracker, deadline: float | None = None
) -> Callable[[int, str | None, float], Awaitable[Verdict]]:
    """A closer's rule: its own claim is kept; another's is judged by its lease."""

    async def decide(attempt: int, holder: str | None, held: float) -> Verdict:
        if holder == me:
            return HOLD
        return judged(tracker, holder, held, deadline=deadline)

    return decide


def test_the_first_claimant_holds_attempt_zero_and_the_second_waits() -> None:
    async def main() -> None:
        box, clock = MemoryMailbox(), Clock()
        tracker = LeaseTracker(LEASE, clock)
        a, b = series(box, "a", clock), series(box, "b", clock)
        assert await a.take(await newest(box), decider("a", tracker)) == 0
        tracker.observe([p.beat_key("a", 0)])  # a is live
        assert await b.take(await newest(box), decider("b", tracker)) is None
        assert await a.take(await newest(box), decider("a", tracker)) == 0  # still a's

    asyncio.run(main())


def test_a_claim_whose_holder_lease_lapsed_is_taken_over_after_a_lease_period() -> None:
    async def main() -> None:
        box, clock = MemoryMailbox(), Clock()
        tracker = LeaseTracker(LEASE, clock)
        a, b = series(box, "a", clock), series(box, "b", clock)
        assert await a.take(None, decider("a", tracker)) == 0
        # b never saw a beat of a: a's lease counts as lapsed, but b must watch the claim
        # itself for a whole lease period (it cannot know how old the claim was).
        assert await b.take(await newest(box), decider("b", tracker)) is None
        clock.now = LEASE - 0.1
        assert await b.take(await newest(box), decider("b", tracker)) is None
        clock.now = LEASE
        assert await b.take(await newest(box), decider("b", tracker)) == 1
        assert await box.list(p.claims_prefix(7)) == [p.claim_key(7, 0), p.claim_key(7, 1)]
        # a sees b's claim as the newest: someone else's, live or not, just seen.
        assert await a.take(await newest(box), decider("a", tracker)) is None

    asyncio.run(main())


def test_a_live_holder_is_replaced_after_the_claim_deadline_only() -> None:
    async def main() -> None:
        box, clock = MemoryMailbox(), Clock()
        tracker = LeaseTracker(LEASE, clock)
        a, b = series(box, "a", clock), series(box, "b", clock)
        assert await a.take(None, decider("a", tracker)) == 0
        for beat in range(5):  # a keeps beating: live all along
            clock.now = beat * LEASE / 2
            tracker.observe([p.beat_key("a", beat)])
            assert await b.take(await newest(box), decider("b", tracker, 3 * LEASE)) is None
        clock.now = 3 * LEASE
        tracker.observe([p.beat_key("a", 6)])
        assert tracker.is_live("a")
        assert await b.take(await newest(box), decider("b", tracker, 3 * LEASE)) == 1

    asyncio.run(main())


def test_a_lost_response_to_our_own_claim_still_counts_as_won() -> None:
    async def main() -> None:
        box, clock = MemoryMailbox(), Clock()
        tracker = LeaseTracker(LEASE, clock)
        # Our first write landed, its response was lost: the retry finds the key taken.
        await box.put_if_absent(p.claim_key(7, 0), p.encode(p.Claim("a")))
        a = series(box, "a", clock)
        assert await a.claim(0)
        assert await a.take(await newest(box), decider("a", tracker)) == 0

    asyncio.run(main())


def test_an_unreadable_claim_fails_over_like_a_dead_holders() -> None:
    async def main() -> None:
        box, clock = MemoryMailbox(), Clock()
        tracker = LeaseTracker(LEASE, clock)
        await box.put_if_absent(p.claim_key(7, 0), b"not a claim")
        b = series(box, "b", clock)
        assert await b.take(await newest(box), decider("b", tracker)) is None
        clock.now = LEASE
        assert await b.take(await newest(box), decider("b", tracker)) == 1

    asyncio.run(main())


def test_attempts_are_bounded_by_the_key_width() -> None:
    async def main() -> None:
        box, clock = MemoryMailbox(), Clock()

        async def always_next(attempt: int, holder: str | None, held: float) -> Verdict:
            return Verdict.NEXT

        with pytest.raises(ProtocolError, match="every claim attempt"):
            await series(box, "a", clock).take(MAX_ATTEMPT, always_next)

    asyncio.run(main())


def commit(closer: str, params: str, attempt: int = 0) -> p.Commit:
    return p.Commit(
        round=7,
        fragment=1,
        base=4,
        contributors=(p.Contribution("a", 3, "blobs/" + "a" * 64),),
        params=params,
        momentum=None,
        closer=closer,
        attempt=attempt,
    )


def test_a_losing_closer_adopts_the_winner_and_deletes_only_its_own_upload() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        theirs, ours = "blobs/" + "1" * 64, "blobs/" + "2" * 64
        for key in (theirs, ours):
            await box.put_if_absent(key, b"payload")
        winner = commit("b", theirs, attempt=0)
        found, won = await write_or_adopt(box, p.round_key(7), winner)
        assert (found, won) == (winner, True)
        found, won = await write_or_adopt(box, p.round_key(7), commit("c", ours, attempt=1))
        assert (found, won) == (winner, False)
        assert await box.get(theirs) is not None
        assert await box.get(ours) is None

    asyncio.run(main())


def test_a_record_that_is_our_own_lost_write_counts_as_won() -> None:
    async def main() -> None:
        box = MemoryMailbox()
        mine = commit("b", "blobs/" + "1" * 64)
        await box.put_if_absent(p.round_key(7), p.encode(mine))  # the response was lost
        found, won = await write_or_adopt(box, p.round_key(7), mine)
        assert (found, won) == (mine, True)

    asyncio.run(main())
