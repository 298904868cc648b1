"""Status: conditions keyed by type, and the mailbox's view of the run."""

from __future__ import annotations

import datetime
from typing import Any

from gradientmail.inspect import RunView
from gradientmail_operator.reconcile import Reason


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions_patch(
    conditions: list[dict[str, Any]], kind: str, ok: bool, reason: Reason, message: str
) -> list[dict[str, Any]]:
    """``conditions`` with the one of type ``kind`` set; its transition time changes only
    when its status does."""
    status = "True" if ok else "False"
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


def view_status(view: RunView) -> dict[str, Any]:
    return {
        "roundsCommitted": view.rounds_committed,
        "newestRound": view.newest_round,
        "newestRoundPerFragment": {str(f): r for f, r in sorted(view.newest_per_fragment.items())},
        "liveLearners": view.live_learners,
        "learners": [
            {"id": lv.learner, "live": lv.live, "steps": lv.steps} for lv in view.learners
        ][:50],
        "samples": view.samples_committed,
        "lastCommitAgeSeconds": (
            None if view.seconds_since_commit is None else round(view.seconds_since_commit, 1)
        ),
        "samplesPerSecond": (
            None if view.samples_per_second is None else round(view.samples_per_second, 1)
        ),
    }
