"""What the run table (``table.py``) shows of a Moshpit run (``algorithms/moshpit.py``).

A Moshpit run has group rounds instead of run-wide rounds: ``status --json`` carries them
as ``groups`` (:func:`groups_json`, None for any other run), and the table shows, from that
dict, the newest group round, how many learners its groups held, the groups still open,
the grid (:func:`group_rows`), a line summing up the newest round (:func:`groups_line`),
and a ``group round`` column per learner: the newest group round it published to, its
version (:func:`group_versions`, :func:`version_cells`).
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from gradientmail.inspect import GroupsView

__all__ = ["group_rows", "group_versions", "groups_json", "groups_line", "version_cells"]


def groups_json(groups: GroupsView | None) -> dict[str, Any] | None:
    """A Moshpit run's group rounds as ``status --json`` shows them (None for another run)."""
    if groups is None:
        return None
    return {
        "group_size": groups.group_size,
        "grid_dims": groups.grid_dims,
        "grid_cells": groups.grid_cells,
        "slots": groups.slots,
        "newest_round": groups.newest_round,
        "rounds": [
            {
                "round": r.round,
                "groups": r.groups,
                "sizes": list(r.sizes),
                "min_size": r.min_size,
                "median_size": r.median_size,
                "max_size": r.max_size,
                "learners": r.learners,
                "samples": r.samples,
            }
            for r in groups.rounds
        ],
        "versions": dict(groups.versions),
        "version_spread": groups.spread,
        "open_groups": {str(t): list(g) for t, g in sorted(groups.open_groups.items())},
        "summary": groups.describe(),
    }


def group_rows(
    grid: Table, shown: dict[str, Any], groups: dict[str, Any], rate: str, lag: str
) -> None:
    """A Moshpit run's numbers, in place of the rounds': its newest group round, the
    learners in its groups, what is still open, the grid. ``shown``: the run's
    ``status --json`` dict, ``groups`` its ``groups``; ``rate`` and ``lag`` as shown."""
    newest = "—" if groups["newest_round"] is None else str(groups["newest_round"])
    in_groups = groups["rounds"][-1]["learners"] if groups["rounds"] else 0
    grid.add_row(
        f"group round [bold]{newest}[/]",
        f"in its groups [bold]{in_groups}[/]",
        f"live learners [bold]{shown['live_learners']}[/]",
    )
    grid.add_row(
        f"samples/s [bold]{rate}[/]",
        f"commit lag [bold]{lag}[/]",
        f"open groups [bold]{sum(len(g) for g in groups['open_groups'].values())}[/]",
    )
    grid.add_row(
        f"grid {'×'.join([str(groups['group_size'])] * groups['grid_dims'])} "
        f"({groups['slots']} slots)",
        f"samples trained {shown['samples_committed']:,}",
        Text(f"creator {shown['creator'] or '—'}"),
    )


def groups_line(groups: dict[str, Any]) -> Text:
    """The line under the run's numbers: ``groups: round 12, 4 groups of 2–4 (median 4),
    versions spread 1``."""
    return Text(f"groups: {groups['summary']}")


def group_versions(shown: dict[str, Any] | None) -> dict[str, int] | None:
    """Each learner's version (the newest group round it published to) for a Moshpit
    run's ``group round`` column; None for any other run (no such column)."""
    groups = None if shown is None else shown.get("groups")
    return None if groups is None else dict(groups["versions"])


def version_cells(versions: dict[str, int] | None, learner: str) -> list[RenderableType]:
    """``learner``'s ``group round`` cell (``—`` before it published), or no cell at all
    when the run has no such column (``versions`` None)."""
    if versions is None:
        return []
    found = versions.get(learner)
    return [Text("—", style="dim") if found is None else Text(str(found))]
