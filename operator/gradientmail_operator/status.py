"""Status: conditions keyed by type, and the mailbox's view of the run.

Sync points (from each learner's newest beat): the status sums them over every learner the
mailbox knows (``syncPointsReached``, ``syncPointsContributed``, ``syncPointsSkipped``,
``waitedSeconds``), lists them per learner, and the ``SyncPointsContributed`` condition says
whether any learner skipped one (``SyncPointsSkipped``) or waits at them a large share of
its time (``WaitingAtSyncPoints``); :func:`sync_warnings` gives the events for a learner
that starts doing either.

A Moshpit run (group rounds, no run-wide ones): ``roundsCommitted`` and ``newestRound`` are
its newest group round, ``samples`` the samples its learners trained, ``groups`` (a field
only such a run has) its newest group round's groups, their sizes and the spread of the
learners' versions (:func:`groups_status`), and each learner its ``groupRound``.
"""

from __future__ import annotations

import datetime
from typing import Any

from gradientmail.inspect import STALLING_FRACTION, GroupsView, LearnerView, RunView
from gradientmail_operator.reconcile import Reason


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions_patch(
    conditions: list[dict[str, Any]], kind: str, ok: bool | None, reason: Reason, message: str
) -> list[dict[str, Any]]:
    """``conditions`` with the one of type ``kind`` set (``ok`` None: Unknown); its
    transition time changes only when its status does."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    result = []
    found = False
    for condition in conditions:
        if condition.get("type") != kind:
            result.append(condition)
            continue
        found = True
        changed = condition.get("status") != status
        result.append(
            {
                "type": kind,
                "status": status,
                "reason": reason.value,
                "message": message,
                "lastTransitionTime": _now() if changed else condition.get("lastTransitionTime"),
            }
        )
    if not found:
        result.append(
            {
                "type": kind,
                "status": status,
                "reason": reason.value,
                "message": message,
                "lastTransitionTime": _now(),
            }
        )
    return result


def _learner(lv: LearnerView) -> dict[str, Any]:
    return {
        "id": lv.learner,
        "live": lv.live,
        "steps": lv.steps,
        "syncPoints": lv.sync_points,
        "contributed": lv.contributed,
        "skipped": lv.skipped,
        "waitedSeconds": None if lv.waited_s is None else round(lv.waited_s, 1),
        "waitingFraction": (None if lv.waiting_fraction is None else round(lv.waiting_fraction, 2)),
    }


def groups_status(groups: GroupsView) -> dict[str, Any]:
    """A Moshpit run's ``status.groups``: its newest group round and that round's groups."""
    newest = groups.newest
    return {
        "newestGroupRound": groups.newest_round,
        "groups": 0 if newest is None else newest.groups,
        "groupSizeMin": None if newest is None else newest.min_size,
        "groupSizeMedian": None if newest is None else newest.median_size,
        "groupSizeMax": None if newest is None else newest.max_size,
        "learnersInGroups": 0 if newest is None else newest.learners,
        "versionSpread": groups.spread,
        "openGroups": sum(len(g) for g in groups.open_groups.values()),
        "gridSlots": groups.slots,
        "grid": "×".join([str(groups.group_size)] * groups.grid_dims),
        "summary": groups.describe(),
    }


def view_status(view: RunView) -> dict[str, Any]:
    sync = view.sync
    learners = [_learner(lv) for lv in view.learners][:50]
    if view.groups is not None:
        versions = view.groups.versions
        for learner in learners:
            learner["groupRound"] = versions.get(learner["id"])
    status = {
        "roundsCommitted": view.rounds_committed,
        "newestRound": view.newest_round,
        "newestRoundPerFragment": {str(f): r for f, r in sorted(view.newest_per_fragment.items())},
        "liveLearners": view.live_learners,
        "learners": learners,
        "samples": view.samples_committed,
        "syncPointsReached": sync.sync_points,
        "syncPointsContributed": sync.contributed,
        "syncPointsSkipped": sync.skipped,
        "waitedSeconds": round(sync.waited_s, 1),
        "lastCommitAgeSeconds": (
            None if view.seconds_since_commit is None else round(view.seconds_since_commit, 1)
        ),
        "samplesPerSecond": (
            None if view.samples_per_second is None else round(view.samples_per_second, 1)
        ),
    }
    if view.groups is not None:
        status["groups"] = groups_status(view.groups)
    return status


def _skips(lv: LearnerView) -> str:
    return f"{lv.learner} skipped {lv.skipped or 0} of {lv.sync_points or 0}"


def _waits(lv: LearnerView) -> str:
    return f"{lv.learner} waited {lv.waiting_fraction or 0:.0%} of the time"


def sync_condition(view: RunView) -> tuple[bool, Reason, str]:
    """The ``SyncPointsContributed`` condition: False while any learner has skipped a sync
    point (its steps there went into a later, longer contribution); True otherwise, with
    ``WaitingAtSyncPoints`` as the reason while a live learner waits at sync points
    STALLING_FRACTION of its time or more."""
    sync = view.sync
    if sync.skipping:
        skipping = [lv for lv in view.learners if lv.skipping]
        names = "; ".join(_skips(lv) for lv in skipping[:10])
        return (
            False,
            Reason.SYNC_POINTS_SKIPPED,
            f"{sync.skipped} of {sync.sync_points} sync points skipped ({names}): those steps "
            "went into later contributions (free_running, a wait that gave up, or a round "
            "that closed without it)",
        )
    if sync.stalling:
        stalling = [lv for lv in view.learners if lv.stalling]
        names = "; ".join(_waits(lv) for lv in stalling[:10])
        return (
            True,
            Reason.WAITING_AT_SYNC_POINTS,
            f"learners wait at sync points ({names}): the mailbox or a round's closer holds "
            "them back",
        )
    if not sync.sync_points:
        return True, Reason.ALL_SYNC_POINTS_CONTRIBUTED, "no sync point reached yet"
    return (
        True,
        Reason.ALL_SYNC_POINTS_CONTRIBUTED,
        f"{sync.contributed} contributions at {sync.sync_points} sync points, none skipped; "
        f"{sync.waited_s:.1f} s waited in all",
    )


def sync_warnings(view: RunView, warned: set[tuple[Reason, str]]) -> list[tuple[Reason, str]]:
    """Warning events for learners that started skipping or stalling since ``warned`` (the
    (reason, learner) pairs already reported, updated in place): one event each, and one
    again for a learner that stalls again after it recovered."""
    events = []
    now = set()
    for lv in view.learners:
        if lv.skipping:
            now.add((Reason.SYNC_POINTS_SKIPPED, lv.learner))
            if (Reason.SYNC_POINTS_SKIPPED, lv.learner) not in warned:
                events.append(
                    (
                        Reason.SYNC_POINTS_SKIPPED,
                        f"learner {_skips(lv)} sync points: those steps went into later, "
                        "longer contributions",
                    )
                )
        if lv.stalling:
            now.add((Reason.WAITING_AT_SYNC_POINTS, lv.learner))
            if (Reason.WAITING_AT_SYNC_POINTS, lv.learner) not in warned:
                events.append(
                    (
                        Reason.WAITING_AT_SYNC_POINTS,
                        f"learner {_waits(lv)} at sync points (at least "
                        f"{STALLING_FRACTION:.0%}): the mailbox or a round's closer holds it "
                        "back",
                    )
                )
    # Skipping stays reported (the count only grows); a stall that ended may be reported again.
    warned -= {item for item in warned if item[0] == Reason.WAITING_AT_SYNC_POINTS} - now
    warned |= now
    return events
