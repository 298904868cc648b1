"""The lines ``gradientmail run`` prints for every run, whatever its nodes train: the
progress line when there is no live table (:func:`status_line`) and the summary that ends
a run that succeeded (:func:`summary`). What it shows of the built-in language model (the
aligned model's loss, the curves, the PNG) is the demo's: :mod:`gradientmail.demo.report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from gradientmail.cli._nodes import Node
    from gradientmail.inspect import RunView

__all__ = ["status_line", "summary"]


def status_line(title: str, view: RunView | None, rate: float | None) -> str:
    """``gradientmail run``'s progress line when there is no live table (every 5 s)."""
    if view is None or not view.exists:
        return f"[{title}] waiting for the run to appear"
    shown = "—" if rate is None else f"{rate:,.0f}"  # each sample counted once
    sync = view.sync
    trouble = ""
    if sync.skipped:
        trouble += f", sync points skipped {sync.skipped} ({', '.join(sync.skipping)})"
    if sync.stalling:
        trouble += f", waiting at sync points: {', '.join(sync.stalling)}"
    if view.groups is not None:  # a Moshpit run: group rounds, no run-wide ones
        return (
            f"[{title}] groups: {view.groups.describe()}, live learners {view.live_learners}, "
            f"samples/s {shown}, sync points {sync.sync_points} (contributed "
            f"{sync.contributed}, waited {sync.waited_s:.1f} s){trouble}"
        )
    return (
        f"[{title}] rounds committed {view.rounds_committed}, live learners "
        f"{view.live_learners}, samples/s {shown}, sync points {sync.sync_points} "
        f"(contributed {sync.contributed}, waited {sync.waited_s:.1f} s){trouble}"
    )


def summary(
    console: Console, nodes: Sequence[Node], view: RunView | None, url: str, elapsed: float
) -> None:
    """The line that ends every run that succeeded, and the commands to try next."""
    rounds = 0 if view is None else view.rounds_committed
    what = "group rounds" if view is not None and view.groups is not None else "training rounds"
    firsts = [n.first_loss for n in nodes if n.first_loss is not None]
    lasts = [n.last_loss for n in nodes if n.last_loss is not None]
    loss = ""
    if firsts and lasts:
        loss = f", mean loss {sum(firsts) / len(firsts):.4f} → {sum(lasts) / len(lasts):.4f}"
    console.print(
        f"\n[green]done[/] in {elapsed:.1f} s: {len(nodes)} nodes, {rounds} {what} committed{loss}"
    )
    console.print("next:")
    console.print(f"  gradientmail status {escape(_quoted(url))}")
    console.print(f"  gradientmail verify {escape(_quoted(url))}")
    console.print(f"  gradientmail align {escape(_quoted(url))} --out model.safetensors")


def _quoted(url: str) -> str:
    return f"'{url}'" if any(c in url for c in "?&; ") else url
