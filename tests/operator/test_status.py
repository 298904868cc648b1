"""The operator's status from a run's mailbox: records written into a real mailbox as the
learners write them, read with ``gradientmail.inspect`` as the operator reads them."""

from __future__ import annotations

import asyncio

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.inspect import RunView, RunWatcher
from gradientmail_operator.reconcile import Reason
from gradientmail_operator.status import sync_condition, sync_warnings, view_status
from tests.inspect.test_inspect import Run


def poll(watcher: RunWatcher) -> RunView:
    return asyncio.run(watcher.poll())


def test_the_status_sums_sync_points_and_lists_them_per_learner() -> None:
    run = Run(gm.MemoryMailbox())
    run.create()
    run.commit(2, {"a": 8, "b": 8})
    run.beat("a", 5, steps=100, sync_points=10, contributed=10, waited_s=3.04)
    run.beat("b", 4, steps=100, sync_points=10, contributed=7, waited_s=0.5, skipped=3)
    run.beat("c", p.LEAVING_BEAT, steps=30, sync_points=3, contributed=3, waited_s=1.0)
    run.old_beat("d", 2, steps=9)  # a learner of a release without the counters
    status = view_status(poll(RunWatcher(run.box)))
    assert status["liveLearners"] == 3
    # Over every learner known, the one that left included: a finished run keeps its totals.
    assert (
        status["syncPointsReached"],
        status["syncPointsContributed"],
        status["syncPointsSkipped"],
        status["waitedSeconds"],
    ) == (23, 20, 3, 4.5)
    assert status["learners"] == [
        {
            "id": "a",
            "live": True,
            "steps": 100,
            "syncPoints": 10,
            "contributed": 10,
            "skipped": 0,
            "waitedSeconds": 3.0,
            "waitingFraction": None,
        },
        {
            "id": "b",
            "live": True,
            "steps": 100,
            "syncPoints": 10,
            "contributed": 7,
            "skipped": 3,
            "waitedSeconds": 0.5,
            "waitingFraction": None,
        },
        {
            "id": "c",
            "live": False,
            "steps": 30,
            "syncPoints": 3,
            "contributed": 3,
            "skipped": 0,
            "waitedSeconds": 1.0,
            "waitingFraction": None,
        },
        {
            "id": "d",
            "live": True,
            "steps": 9,
            "syncPoints": 0,
            "contributed": 0,
            "skipped": 0,
            "waitedSeconds": 0.0,
            "waitingFraction": None,
        },
    ]


def test_the_condition_and_events_follow_skipping_and_waiting() -> None:
    now = [0.0]
    run = Run(gm.MemoryMailbox())
    run.create()
    watcher = RunWatcher(run.box, lease_timeout=60.0, clock=lambda: now[0], wait_window=30.0)
    warned: set[tuple[Reason, str]] = set()

    view = poll(watcher)
    assert sync_condition(view) == (
        True,
        Reason.ALL_SYNC_POINTS_CONTRIBUTED,
        "no sync point reached yet",
    )

    run.beat("a", 1, sync_points=2, contributed=2, waited_s=0.0)
    run.beat("b", 1, sync_points=2, contributed=2, waited_s=0.0)
    view = poll(watcher)
    assert sync_condition(view) == (
        True,
        Reason.ALL_SYNC_POINTS_CONTRIBUTED,
        "4 contributions at 4 sync points, none skipped; 0.0 s waited in all",
    )
    assert sync_warnings(view, warned) == []

    # b waits 6 s of the next 10: stalling (a status that stays True, and an event once).
    now[0] += 10.0
    run.beat("a", 2, sync_points=3, contributed=3, waited_s=0.1)
    run.beat("b", 2, sync_points=3, contributed=3, waited_s=6.0)
    view = poll(watcher)
    ok, reason, message = sync_condition(view)
    assert (ok, reason) == (True, Reason.WAITING_AT_SYNC_POINTS)
    assert "b waited 60% of the time" in message
    assert sync_warnings(view, warned) == [
        (
            Reason.WAITING_AT_SYNC_POINTS,
            "learner b waited 60% of the time at sync points (at least 25%): the mailbox or a "
            "round's closer holds it back",
        )
    ]
    assert sync_warnings(view, warned) == []  # reported once

    # a starts skipping: the condition turns False, with one Warning event for a.
    now[0] += 10.0
    run.beat("a", 3, sync_points=5, contributed=3, waited_s=0.1, skipped=2)
    view = poll(watcher)
    ok, reason, message = sync_condition(view)
    assert (ok, reason) == (False, Reason.SYNC_POINTS_SKIPPED)
    assert message.startswith("2 of 8 sync points skipped (a skipped 2 of 5)")
    events = sync_warnings(view, warned)
    assert [r for r, _ in events] == [Reason.SYNC_POINTS_SKIPPED]
    assert events[0][1].startswith("learner a skipped 2 of 5 sync points")
    assert view_status(view)["syncPointsSkipped"] == 2

    # b recovers, then stalls again: reported again; a's skipping is not reported twice.
    for waited in (6.0, 6.0, 6.0, 6.0):
        now[0] += 10.0
        run.beat("b", 3 + int(now[0]), sync_points=4, contributed=4, waited_s=waited)
        view = poll(watcher)
        assert not view.learners[1].stalling
        assert sync_warnings(view, warned) == []
    now[0] += 10.0
    run.beat("b", 100, sync_points=5, contributed=5, waited_s=50.0)
    view = poll(watcher)
    assert [r for r, _ in sync_warnings(view, warned)] == [Reason.WAITING_AT_SYNC_POINTS]


def test_reasons_are_distinct() -> None:
    values = [reason.value for reason in Reason]
    assert len(values) == len(set(values))
