"""The run table (``gradientmail run`` and ``status``) and ``gradientmail status``.

Everything shown comes from :class:`gradientmail.inspect.RunView` (the mailbox alone),
plus, under ``run``, what the local node processes printed (steps, loss, exit status).
Per learner it shows the sync points reached (``syncs``), the contributions made at them
(``contrib``), those skipped (``skipped``, red when any) and the seconds ``step()`` waited
at them (``waited``, with the recent share of time under ``--watch``; yellow when it is
:data:`~gradientmail.inspect.STALLING_FRACTION` or more); a line under the run's numbers
names the learners that skip or stall.
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
from gradientmail.errors import MailboxError
from gradientmail.inspect import STALLING_FRACTION, LearnerView, RunView, RunWatcher

__all__ = ["NodeRow", "SampleRate", "render_run", "view_json"]


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


def _loss(first: float | None, last: float | None) -> Text:
    if last is None:
        return Text("—", style="dim")
    if first is None or first == last:
        return Text(f"{last:.4f}")
    style = "green" if last < first else "yellow"
    return Text.assemble((f"{first:.4f} → ", "dim"), (f"{last:.4f}", style))


def _lease(view: LearnerView | None, polls: int) -> Text:
    if view is None:
        return Text("no beat yet", style="dim")
    # One poll cannot tell a beat's age: the observer's clock starts at the first.
    age = f" ({view.seconds_since_beat:.1f} s)" if polls > 1 else ""
    if view.leaving:
        return Text("left" + age, style="dim")
    return Text("live" + age, style="green") if view.live else Text("lapsed" + age, style="red")


def _count(value: int | None, bad: bool = False) -> Text:
    if value is None:
        return Text("—", style="dim")
    return Text(f"{value:,}", style="bold red" if bad and value > 0 else "")


def _waited(view: LearnerView | None, polls: int, share: bool) -> Text:
    if view is None or view.waited_s is None:
        return Text("—", style="dim")
    text = f"{view.waited_s:,.1f} s"
    if share and view.waiting_fraction is not None and polls > 1:
        text += f" ({view.waiting_fraction:.0%})"
    return Text(text, style="bold yellow" if view.stalling else "")


def _sync_cells(view: LearnerView | None, polls: int, share: bool) -> list[RenderableType]:
    if view is None:
        return [Text("—", style="dim")] * 4
    return [
        _count(view.sync_points),
        _count(view.contributed),
        _count(view.skipped, bad=True),
        _waited(view, polls, share),
    ]


def _flags(view: RunView) -> list[RenderableType]:
    """A line for each kind of trouble at sync points, naming the learners."""
    lines: list[RenderableType] = []
    skipping = [v for v in view.learners if v.skipping]
    if skipping:
        who = ", ".join(f"{v.learner} ({v.skipped:,} of {v.sync_points or 0:,})" for v in skipping)
        lines.append(
            Text(
                f"skipping sync points: {who}; those steps went into later, longer contributions",
                style="red",
            )
        )
    stalling = [v for v in view.learners if v.stalling]
    if stalling:
        who = ", ".join(f"{v.learner} ({v.waiting_fraction or 0:.0%})" for v in stalling)
        lines.append(
            Text(
                f"waiting at sync points {STALLING_FRACTION:.0%} of the time or more: {who}; "
                "the mailbox or a round's closer is holding them back",
                style="yellow",
            )
        )
    return lines


def _summary(view: RunView | None, polls: int, rate: float | None) -> Table:
    grid = Table.grid(padding=(0, 3))
    for _ in range(3):
        grid.add_column(no_wrap=True)
    if view is None or not view.exists:
        grid.add_row(Text("waiting for the run to appear in the mailbox…", style="dim"))
        return grid
    fragments = "—" if view.fragments is None else str(view.fragments)
    newest = "—" if view.newest_round is None else str(view.newest_round)
    # samples_committed (and so the rate) counts each trained sample once (RunView's docs).
    shown_rate = _number(rate, digits=0) if polls > 1 else "—"
    lag = _number(view.seconds_since_commit, " s") if polls > 1 else "—"
    grid.add_row(
        f"rounds committed [bold]{view.rounds_committed}[/]",
        f"newest round [bold]{newest}[/]",
        f"live learners [bold]{view.live_learners}[/]",
    )
    grid.add_row(
        f"samples/s [bold]{shown_rate}[/]",
        f"commit lag [bold]{lag}[/]",
        f"open rounds [bold]{len(view.open_rounds)}[/]",
    )
    grid.add_row(
        f"fragments {fragments}",
        f"samples committed {view.samples_committed:,}",
        f"creator {view.creator or '—'}",
    )
    sync = view.sync
    grid.add_row(
        f"sync points reached {sync.sync_points:,}",
        f"contributed {sync.contributed:,}",
        Text.assemble(
            "skipped ",
            (f"{sync.skipped:,}", "bold red" if sync.skipped else "bold"),
            f"   waited {sync.waited_s:,.1f} s",
        ),
    )
    return grid


def _learners(view: RunView | None, nodes: Sequence[NodeRow] | None, polls: int) -> Table:
    seen = {v.learner: v for v in view.learners} if view is not None else {}
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
    table.add_column("lease (last beat)")
    shown: set[str] = set()
    for node in nodes or ():
        shown.add(node.learner)
        lv = seen.get(node.learner)
        step = max(node.step, lv.steps or 0 if lv else 0)
        if node.total:
            bar = ProgressBar(total=node.total, completed=min(step, node.total), width=16)
            progress: RenderableType = Table.grid(padding=(0, 1))
            assert isinstance(progress, Table)
            progress.add_row(bar, Text(f"{step}/{node.total}"))
        else:
            progress = Text(str(step))
        state = node.state + (f" (restarts {node.restarts})" if node.restarts else "")
        style = (
            "red"
            if node.state.startswith("failed")
            else "green"
            if node.state == "done"
            else "yellow"
            if node.state == "stopped"
            else ""
        )
        table.add_row(
            node.learner,
            Text(state, style=style),
            progress,
            _loss(node.first_loss, node.last_loss),
            _number(lv.samples, digits=0) if lv and lv.samples is not None else "—",
            *_sync_cells(lv, polls, share=not wide),
            _lease(lv, polls),
        )
    for learner, lv in seen.items():
        if learner in shown:
            continue
        cells: list[RenderableType] = [learner]
        if nodes is not None:
            cells += [Text("elsewhere", style="dim"), Text(str(lv.steps or 0)), Text("—")]
        else:
            cells.append("—" if lv.steps is None else f"{lv.steps:,}")
        cells.append("—" if lv.samples is None else f"{lv.samples:,}")
        cells += [*_sync_cells(lv, polls, share=not wide), _lease(lv, polls)]
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
) -> RenderableType:
    """The whole table: a title line, the run's numbers, one row per learner. ``rate``
    (samples/s) defaults to the view's own."""
    if rate is None and view is not None:
        rate = view.samples_per_second
    parts: list[RenderableType] = [Text(title, style="bold"), _summary(view, polls, rate)]
    if view is not None and view.exists:
        parts += _flags(view)
    if error:
        parts.append(Text(f"mailbox: {error}", style="red"))
    if nodes or (view is not None and view.learners):
        parts += [Text(""), _learners(view, nodes, polls)]
    return Group(*parts)


def view_json(url: str, view: RunView) -> dict[str, Any]:
    sync = view.sync
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
        "seconds_since_commit": view.seconds_since_commit,
        "samples_per_second": view.samples_per_second,
        "sync": {
            "sync_points": sync.sync_points,
            "contributed": sync.contributed,
            "waited_s": sync.waited_s,
            "skipped": sync.skipped,
            "skipping": list(sync.skipping),
            "stalling": list(sync.stalling),
        },
        "learners": [
            {
                "learner": v.learner,
                "live": v.live,
                "leaving": v.leaving,
                "beat": v.beat,
                "steps": v.steps,
                "samples": v.samples,
                "seconds_since_beat": v.seconds_since_beat,
                "sync_points": v.sync_points,
                "contributed": v.contributed,
                "waited_s": v.waited_s,
                "skipped": v.skipped,
                "waiting_fraction": v.waiting_fraction,
                "skipping": v.skipping,
                "stalling": v.stalling,
            }
            for v in view.learners
        ],
    }


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
                    print(json.dumps(view_json(url, view)), flush=True)
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
