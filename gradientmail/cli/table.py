"""The run table (``gradientmail run`` and ``status``) and ``gradientmail status``.

Everything shown comes from :class:`gradientmail.inspect.RunView` (the mailbox alone),
plus, under ``run``, what the local node processes printed (steps, loss, exit status).
Per learner it shows the sync points reached (``syncs``), the contributions made at them
(``contrib``), those skipped (``skipped``, red when any) and the seconds ``step()`` waited
at them (``waited``, with the recent share of time under ``--watch``; yellow when it is
:data:`~gradientmail.inspect.STALLING_FRACTION` or more); a line under the run's numbers
names the learners that skip or stall.

For a Moshpit run (``algorithms/moshpit.py``) it shows group rounds instead of rounds: the
newest group round, how many groups committed in it and their sizes, the spread of the
learners' versions (the newest group round each published to; a column per learner), and
the grid; ``groups`` in JSON (None for any other run). ``_groups_table.py`` renders those.

The table is rendered from the dict ``status --json`` prints (:func:`view_json`), so the
two agree field by field. An age needs the watcher to see a change: one poll shows none
(``—``, null), and one marked ``≥`` (``*_at_least`` in JSON) is a lower bound, for a beat
or commit that was already there when watching began. A learner that left shows
``left``, never the leaving beat's number.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gradientmail.cli._common import (
    CliError,
    EmptyPrefix,
    err,
    mailbox_for,
    out,
    read_head,
    store_error,
)
from gradientmail.cli._groups_table import (
    group_rows,
    group_versions,
    groups_json,
    groups_line,
    version_cells,
)
from gradientmail.errors import MailboxError
from gradientmail.inspect import STALLING_FRACTION, LearnerView, RunView, RunWatcher

__all__ = ["NodeRow", "SampleRate", "groups_json", "render_run", "view_json"]


class SampleRate:
    """Samples committed per second over the last ``window`` seconds of polls: steadier
    than the rate between two polls, since a round commits many steps' samples at once."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._points: deque[tuple[float, int]] = deque()

    def add(self, now: float, samples: int) -> None:
        self._points.append((now, samples))
        while len(self._points) > 2 and now - self._points[1][0] >= self.window:
            self._points.popleft()

    def value(self) -> float | None:
        if len(self._points) < 2:
            return None
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        return (s1 - s0) / (t1 - t0) if t1 - t0 >= 0.5 else None


@dataclass(frozen=True)
class NodeRow:
    """A local node process, as ``gradientmail run`` knows it."""

    learner: str
    state: str  # starting, training, finishing, done, failed (exit N), stopped
    step: int  # newest step it printed (0 if none)
    total: int | None  # steps it was asked for (GRADIENTMAIL_STEPS)
    first_loss: float | None
    last_loss: float | None
    restarts: int


def _number(value: float | None, unit: str = "", digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "—"
    return f"{value:,.{digits}f}{unit}"


def _age(seconds: float | None, at_least: bool) -> str:
    """An age as shown: ``—`` when unknown, ``≥ 12.0 s`` when only a lower bound."""
    if seconds is None:
        return "—"
    return f"{'≥ ' if at_least else ''}{seconds:,.1f} s"


def _loss(first: float | None, last: float | None) -> Text:
    if last is None:
        return Text("—", style="dim")
    if first is None or first == last:
        return Text(f"{last:.4f}")
    style = "green" if last < first else "yellow"
    return Text.assemble((f"{first:.4f} → ", "dim"), (f"{last:.4f}", style))


# -- what is shown: one dict per run, the same for the table and `status --json` ---------


def _lease_state(view: LearnerView) -> str:
    return "left" if view.leaving else "live" if view.live else "lapsed"


def _learner_json(view: LearnerView, polls: int) -> dict[str, Any]:
    # An age needs a beat seen to change: one poll cannot tell it, and a beat that was there
    # when the watcher started is at least as old as the watching (a finished run).
    age: float | None = view.seconds_since_beat
    at_least = not view.beat_age_known
    if at_least and polls <= 1:
        age = None
    return {
        "learner": view.learner,
        "lease": _lease_state(view),
        "live": view.live,
        "leaving": view.leaving,
        # The leaving beat's number is a marker (the largest key), not a count of beats.
        "beat": None if view.leaving else view.beat,
        "steps": view.steps,
        "samples": view.samples,
        "seconds_since_beat": age,
        "beat_age_at_least": age is not None and at_least,
        "sync_points": view.sync_points,
        "contributed": view.contributed,
        "waited_s": view.waited_s,
        "skipped": view.skipped,
        "bytes_up": view.bytes_up,
        "bytes_down": view.bytes_down,
        "waiting_fraction": view.waiting_fraction,
        "skipping": view.skipping,
        "stalling": view.stalling,
    }


def view_json(
    url: str, view: RunView, *, polls: int = 1, rate: float | None = None
) -> dict[str, Any]:
    """What ``status --json`` prints, and what the table shows (it renders this dict).

    ``polls``: how many polls the watcher made (ages and rates need more than one);
    ``rate``: samples per second as the caller measures it (default: the view's own).
    """
    sync = view.sync
    traffic = view.traffic
    if rate is None:
        rate = view.samples_per_second
    lag: float | None = view.seconds_since_commit
    lag_at_least = not view.commit_age_known
    if polls <= 1:
        lag = None  # one poll cannot tell the age of a commit already there
    return {
        "url": url,
        "exists": view.exists,
        "creator": view.creator,
        "fragments": view.fragments,
        "algorithm": None if view.algorithm is None else dict(view.algorithm),
        "rounds_committed": view.rounds_committed,
        "newest_round": view.newest_round,
        "newest_per_fragment": {str(f): r for f, r in sorted(view.newest_per_fragment.items())},
        "last_contributors": list(view.last_contributors),
        "samples_committed": view.samples_committed,
        "live_learners": view.live_learners,
        "open_rounds": {str(r): list(who) for r, who in sorted(view.open_rounds.items())},
        "seconds_since_commit": lag,
        "commit_age_at_least": lag is not None and lag_at_least,
        "samples_per_second": rate if polls > 1 else None,
        "sync": {
            "sync_points": sync.sync_points,
            "contributed": sync.contributed,
            "waited_s": sync.waited_s,
            "skipped": sync.skipped,
            "skipping": list(sync.skipping),
            "stalling": list(sync.stalling),
        },
        "compression": view.compression,
        "dtypes": list(view.dtypes),
        "traffic": {
            "bytes_up": traffic.bytes_up,
            "bytes_down": traffic.bytes_down,
            "dense_estimate": traffic.dense,
            "times_fewer_than_dense": traffic.ratio,
        },
        "learners": [_learner_json(v, polls) for v in view.learners],
        "groups": groups_json(view.groups),
    }


# -- the table, rendered from that dict ------------------------------------------------------


def _lease(learner: dict[str, Any] | None) -> Text:
    if learner is None:
        return Text("no beat yet", style="dim")
    state: str = learner["lease"]
    age = learner["seconds_since_beat"]
    text = state if age is None else f"{state} ({_age(age, learner['beat_age_at_least'])})"
    style = {"left": "dim", "live": "green"}.get(state, "red")
    return Text(text, style=style)


def _count(value: int | None, bad: bool = False) -> Text:
    if value is None:
        return Text("—", style="dim")
    return Text(f"{value:,}", style="bold red" if bad and value > 0 else "")


def _waited(learner: dict[str, Any] | None, share: bool) -> Text:
    if learner is None or learner["waited_s"] is None:
        return Text("—", style="dim")
    text = f"{learner['waited_s']:,.1f} s"
    fraction = learner["waiting_fraction"]
    if share and fraction is not None:
        text += f" ({fraction:.0%})"
    return Text(text, style="bold yellow" if learner["stalling"] else "")


def _sync_cells(learner: dict[str, Any] | None, share: bool) -> list[RenderableType]:
    if learner is None:
        return [Text("—", style="dim")] * 4
    return [
        _count(learner["sync_points"]),
        _count(learner["contributed"]),
        _count(learner["skipped"], bad=True),
        _waited(learner, share),
    ]


def _flags(shown: dict[str, Any]) -> list[RenderableType]:
    """A line for each kind of trouble at sync points, naming the learners."""
    lines: list[RenderableType] = []
    skipping = [v for v in shown["learners"] if v["skipping"]]
    if skipping:
        who = ", ".join(
            f"{v['learner']} ({v['skipped']:,} of {v['sync_points'] or 0:,})" for v in skipping
        )
        lines.append(
            Text(
                f"skipping sync points: {who}; those steps went into later, longer contributions",
                style="red",
            )
        )
    stalling = [v for v in shown["learners"] if v["stalling"]]
    if stalling:
        who = ", ".join(f"{v['learner']} ({v['waiting_fraction'] or 0:.0%})" for v in stalling)
        lines.append(
            Text(
                f"waiting at sync points {STALLING_FRACTION:.0%} of the time or more: {who}; "
                "the mailbox or a round's closer is holding them back",
                style="yellow",
            )
        )
    return lines


def _summary(shown: dict[str, Any] | None) -> RenderableType:
    grid = Table.grid(padding=(0, 3))
    for _ in range(3):
        grid.add_column(no_wrap=True)
    if shown is None or not shown["exists"]:
        grid.add_row(Text("waiting for the run to appear in the mailbox…", style="dim"))
        return grid
    fragments = "—" if shown["fragments"] is None else str(shown["fragments"])
    newest = "—" if shown["newest_round"] is None else str(shown["newest_round"])
    # samples_committed (and so the rate) counts each trained sample once (RunView's docs).
    rate = _number(shown["samples_per_second"], digits=0)
    lag = _age(shown["seconds_since_commit"], shown["commit_age_at_least"])
    groups = shown.get("groups")
    if groups is not None:  # a Moshpit run: group rounds, no run-wide ones
        group_rows(grid, shown, groups, rate, lag)
    else:
        grid.add_row(
            f"rounds committed [bold]{shown['rounds_committed']}[/]",
            f"newest round [bold]{newest}[/]",
            f"live learners [bold]{shown['live_learners']}[/]",
        )
        grid.add_row(
            f"samples/s [bold]{rate}[/]",
            f"commit lag [bold]{lag}[/]",
            f"open rounds [bold]{len(shown['open_rounds'])}[/]",
        )
        grid.add_row(
            f"fragments {fragments}",
            f"samples committed {shown['samples_committed']:,}",
            Text(f"creator {shown['creator'] or '—'}"),
        )
    sync = shown["sync"]
    grid.add_row(
        f"sync points reached {sync['sync_points']:,}",
        f"contributed {sync['contributed']:,}",
        Text.assemble(
            "skipped ",
            (f"{sync['skipped']:,}", "bold red" if sync["skipped"] else "bold"),
            f"   waited {sync['waited_s']:,.1f} s",
        ),
    )
    traffic = shown.get("traffic")
    if traffic is not None:
        moved = traffic["bytes_up"] + traffic["bytes_down"]
        ratio = traffic["times_fewer_than_dense"]
        grid.add_row(
            f"compression {shown['compression']}",
            f"moved {_megabytes(moved)}",
            "" if ratio is None else f"{ratio:,.1f}× fewer bytes than dense float32",
        )
    if groups is not None:
        return Group(grid, groups_line(groups))
    return grid


def _megabytes(count: int) -> str:
    return f"{count / 1e6:,.1f} MB" if count >= 100_000 else f"{count / 1e3:,.1f} kB"


def _state(node: NodeRow) -> Text:
    """``failed (exit 1, restarts 2)``: one pair of parentheses."""
    state = node.state
    if node.restarts:
        more = f"restarts {node.restarts}"
        state = f"{state[:-1]}, {more})" if state.endswith(")") else f"{state} ({more})"
    style = (
        "red"
        if node.state.startswith("failed")
        else "green"
        if node.state == "done"
        else "yellow"
        if node.state == "stopped"
        else ""
    )
    return Text(state, style=style)


def _progress(step: int, total: int | None) -> RenderableType:
    """``120/200`` with a bar; past the total (the count of a learner that rejoined runs
    on across its restarts, while each start trains ``total``), a full bar and
    ``674 (200 per start)``."""
    if not total:
        return Text(str(step))
    bar = ProgressBar(total=total, completed=min(step, total), width=16)
    grid = Table.grid(padding=(0, 1))
    label = f"{step}/{total}" if step <= total else f"{step} ({total} per start)"
    grid.add_row(bar, Text(label))
    return grid


def _node_samples(node: NodeRow, learner: dict[str, Any] | None) -> Text:
    """A learner's samples come from its newest beat; a beat from before its first step
    (the join, or a start barrier) says nothing yet of a node that is training: ``—``."""
    if learner is None or learner["samples"] is None:
        return Text("—", style="dim")
    if not learner["steps"] and node.step > 0:
        return Text("—", style="dim")
    return Text(f"{learner['samples']:,}")


def _learners(shown: dict[str, Any] | None, nodes: Sequence[NodeRow] | None) -> Table:
    seen: dict[str, dict[str, Any]] = (
        {v["learner"]: v for v in shown["learners"]} if shown is not None else {}
    )
    # Under `run` the table is wide (process, progress, loss): one space between columns,
    # and the waiting share only in the flag line, so it fits 130 columns. Narrower, the
    # loss and lease cells wrap onto a second line first; the numbers are never cut.
    wide = nodes is not None
    table = Table(
        expand=False, pad_edge=False, box=None, header_style="bold", collapse_padding=wide
    )
    table.add_column("learner", no_wrap=True)
    if nodes is not None:
        table.add_column("process", no_wrap=True)
        table.add_column("progress", no_wrap=True)
        table.add_column("loss")
    else:
        table.add_column("steps", justify="right", no_wrap=True)
    table.add_column("samples", justify="right", no_wrap=True)
    for heading in ("syncs", "contrib", "skipped", "waited"):
        table.add_column(heading, justify="right", no_wrap=True)
    versions = group_versions(shown)
    if versions is not None:  # a Moshpit run: each learner's group round
        table.add_column("group round", justify="right", no_wrap=True)
    table.add_column("lease (last beat)")

    shown_rows: set[str] = set()
    for node in nodes or ():
        shown_rows.add(node.learner)
        lv = seen.get(node.learner)
        step = max(node.step, (lv["steps"] or 0) if lv else 0)
        table.add_row(
            node.learner,
            _state(node),
            _progress(step, node.total),
            _loss(node.first_loss, node.last_loss),
            _node_samples(node, lv),
            *_sync_cells(lv, share=not wide),
            *version_cells(versions, node.learner),
            _lease(lv),
        )
    for learner, lv in seen.items():
        if learner in shown_rows:
            continue
        cells: list[RenderableType] = [learner]
        if nodes is not None:
            cells += [Text("elsewhere", style="dim"), Text(str(lv["steps"] or 0)), Text("—")]
        else:
            cells.append("—" if lv["steps"] is None else f"{lv['steps']:,}")
        cells.append("—" if lv["samples"] is None else f"{lv['samples']:,}")
        cells += [*_sync_cells(lv, share=not wide), *version_cells(versions, learner), _lease(lv)]
        table.add_row(*cells)
    return table


def render_run(
    title: str,
    view: RunView | None,
    *,
    polls: int,
    nodes: Sequence[NodeRow] | None = None,
    error: str | None = None,
    rate: float | None = None,
    notes: Sequence[RenderableType] = (),
) -> RenderableType:
    """The whole table: a title line, the run's numbers, one row per learner. ``rate``
    (samples/s) defaults to the view's own. It shows :func:`view_json`'s fields, and
    ``notes`` under the run's numbers (``gradientmail run``: the aligned model's loss)."""
    shown = None if view is None else view_json("", view, polls=polls, rate=rate)
    parts: list[RenderableType] = [Text(title, style="bold"), _summary(shown), *notes]
    if shown is not None and shown["exists"]:
        parts += _flags(shown)
    if error:
        parts.append(Text(f"mailbox: {error}", style="red"))
    if nodes or (shown is not None and shown["learners"]):
        parts += [Text(""), _learners(shown, nodes)]
    return Group(*parts)


# -- gradientmail status -------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    status = sub.add_parser(
        "status",
        help="show a run's rounds, learners and throughput, read from its mailbox",
        description="Show a run's rounds, live learners, throughput and commit lag, read "
        "from its mailbox alone (never writes).",
    )
    status.add_argument("url", help="the run's mailbox URL (file:///dir or s3://bucket/prefix)")
    status.add_argument("--watch", action="store_true", help="keep polling until Ctrl-C")
    status.add_argument("--json", action="store_true", help="print JSON (one line per poll)")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between polls (1)")
    status.add_argument(
        "--lease-timeout",
        type=float,
        default=15.0,
        help="seconds without a beat before a learner counts as lapsed (15, the Session default)",
    )


async def _status(args: argparse.Namespace) -> int:
    url: str = args.url
    box = mailbox_for(url)
    watcher = RunWatcher(box, lease_timeout=args.lease_timeout)
    console = out()
    try:
        if not args.watch:
            await read_head(box, url)  # an empty or foreign prefix: say so, exit 1
            view = await watcher.poll()
            if args.json:
                print(json.dumps(view_json(url, view)), flush=True)
            else:
                console.print(render_run(f"run at {url}", view, polls=1))
            return 0
        live = None
        if not args.json and console.is_terminal:
            live = Live(console=console, auto_refresh=False)
            live.start()
        try:
            polls = 0
            rate = SampleRate()
            while True:
                view = await watcher.poll()
                polls += 1
                rate.add(time.monotonic(), view.samples_committed)
                if not view.exists:
                    with contextlib.suppress(EmptyPrefix):  # foreign: fail; empty: wait
                        await read_head(box, url)
                if args.json:
                    shown = view_json(url, view, polls=polls, rate=rate.value())
                    print(json.dumps(shown), flush=True)
                else:
                    title = f"run at {url}  (every {args.interval:g} s; Ctrl-C stops)"
                    table = render_run(title, view, polls=polls, rate=rate.value())
                    if live is not None:
                        live.update(table, refresh=True)
                    else:
                        console.print(table)
                await asyncio.sleep(args.interval)
        finally:
            if live is not None:
                live.stop()
    except MailboxError as exc:
        raise store_error(url, exc) from None


def run_status(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise CliError("--interval must be positive", 2)
    try:
        return asyncio.run(_status(args))
    except KeyboardInterrupt:
        if args.watch:
            err().print("stopped watching")
            return 0
        raise
