"""What ``gradientmail run`` shows of the built-in language model: the aligned model's
validation loss while the run goes, and at the end its curve beside one node's, a PNG of
both in the run folder, and a few lines the aligned model writes.

**Who evaluates the aligned model.** The aligned model is what :func:`gradientmail.align`
loads: the newest commit of every fragment, or for a Moshpit run (no run-wide commits) the
average of the newest group round's commits. :class:`AlignedEval` evaluates it in the
``gradientmail run`` process, on a thread, on the same fixed validation windows the nodes
know (:func:`gradientmail._lm.cached_corpus`): at most every ``interval`` seconds and only
when a round was committed since the last evaluation. That is one forward pass over 64
windows (about 60 ms of one core for the default model) every few seconds, done once for
the run. Having the nodes publish it instead would cost each of them the same evaluation
(they would each have to align too, since no node holds the aligned model: each trains
on between syncs), put a record that is not part of the protocol into the mailbox, and
slow the training they share the cores with.

**The node's curve** is node 0's own local model, which it evaluates on the same windows
at each progress line (``val Y``): a model that trains on its shard alone between syncs
and takes the aligned values of a fragment at each of that fragment's sync points (under
Moshpit, its group's average at each sync). It is labelled as such, not as "a node
alone": no node trains without the others here. :func:`curve_notes` says which, by the
algorithm the run's manifest names.

The terminal sparkline (:func:`sparkline`) and the PNG (:func:`plot_png`, written with
``zlib`` and ``struct``: no plotting dependency) are torch-free; torch is imported only on
the evaluator's thread and in :func:`finish`, when the built-in LM runs.
"""

from __future__ import annotations

import itertools
import json
import logging
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

if TYPE_CHECKING:
    from gradientmail.cli._nodes import Node
    from gradientmail.inspect import RunView
    from gradientmail.mailbox import Mailbox
    from gradientmail.node import LmSettings

__all__ = [
    "AlignedEval",
    "Curve",
    "curve_notes",
    "finish",
    "plot_png",
    "png_bytes",
    "run_algorithm",
    "sparkline",
    "status_line",
    "summary",
]

log = logging.getLogger("gradientmail")

GLYPHS = "▁▂▃▄▅▆▇█"
PROMPTS = (b"def test_", b"    def __init__(self", b"        self.assert")
ALIGNED_COLOR = (31, 119, 180)  # blue
NODE_COLOR = (255, 127, 14)  # orange


# -- a curve, as text ----------------------------------------------------------------------


def sparkline(
    values: Sequence[float | None], *, lo: float | None = None, hi: float | None = None
) -> str:
    """One glyph per value, ``▁`` at ``lo`` (default the smallest) to ``█`` at ``hi``
    (default the largest), ``None`` as a space; two curves drawn with the same ``lo`` and
    ``hi`` compare by eye. Values outside the range are clipped; a flat curve is all ``▄``."""
    known = [v for v in values if v is not None]
    if not known:
        return " " * len(values)
    low = min(known) if lo is None else lo
    high = max(known) if hi is None else hi
    top = len(GLYPHS) - 1
    out = []
    for value in values:
        if value is None:
            out.append(" ")
        elif high <= low:
            out.append(GLYPHS[3])
        else:
            share = (min(max(value, low), high) - low) / (high - low)
            out.append(GLYPHS[round(share * top)])
    return "".join(out)


def binned(points: Sequence[tuple[float, float]], width: int, end: float) -> list[float | None]:
    """``width`` columns over the seconds ``[0, end]``: each the mean of the points that fall
    in it, else the column before it (``None`` before the first point). Curves binned with
    the same ``end`` line up in time."""
    sums = [0.0] * width
    counts = [0] * width
    for t, value in points:
        column = min(width - 1, max(0, int(t / end * width))) if end > 0 else width - 1
        sums[column] += value
        counts[column] += 1
    out: list[float | None] = []
    for total, count in zip(sums, counts, strict=True):
        out.append(total / count if count else (out[-1] if out else None))
    return out


# -- a curve, as a PNG ---------------------------------------------------------------------


def png_bytes(width: int, height: int, rows: Sequence[bytes]) -> bytes:
    """A PNG of 8-bit RGB ``rows`` (``height`` rows of ``3 * width`` bytes each)."""
    if width < 1 or height < 1 or len(rows) != height or any(len(r) != 3 * width for r in rows):
        raise ValueError(f"png_bytes: {height} rows of {3 * width} bytes expected")

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    raw = b"".join(b"\x00" + row for row in rows)  # filter type 0 (None) on every row
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def plot_png(
    path: Path,
    series: Sequence[tuple[Sequence[tuple[float, float]], tuple[int, int, int]]],
    *,
    width: int = 640,
    height: int = 360,
) -> None:
    """A line plot of ``series`` (points ``(x, y)`` and a colour each) on shared axes from
    zero: white background, grey axes and a light grid of 4 × 4 cells, no text (the
    terminal and ``curves.json`` give the numbers)."""
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    margin = 20
    x0, y0, x1, y1 = margin, margin, width - margin - 1, height - margin - 1

    def put(x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[y][3 * x : 3 * x + 3] = bytes(color)

    for i in range(5):  # grid, then axes
        gx = x0 + (x1 - x0) * i // 4
        gy = y0 + (y1 - y0) * i // 4
        for y in range(y0, y1 + 1):
            put(gx, y, (225, 225, 225))
        for x in range(x0, x1 + 1):
            put(x, gy, (225, 225, 225))
    for y in range(y0, y1 + 1):
        put(x0, y, (90, 90, 90))
    for x in range(x0, x1 + 1):
        put(x, y1, (90, 90, 90))
    every = [p for points, _ in series for p in points]
    if every:
        # Both axes from zero (seconds, and a loss, which is never negative): a fall looks
        # as large as it is. A little room above the highest point.
        xs, ys = [p[0] for p in every], [p[1] for p in every]
        lx, hx = min(0.0, *xs), max(xs)
        ly, hy = min(0.0, *ys), max(ys) * 1.05
        hx, hy = (hx if hx > lx else lx + 1), (hy if hy > ly else ly + 1)

        def at(point: tuple[float, float]) -> tuple[int, int]:
            x = x0 + round((point[0] - lx) / (hx - lx) * (x1 - x0))
            y = y1 - round((point[1] - ly) / (hy - ly) * (y1 - y0))
            return x, y

        for points, color in series:
            spots = [at(p) for p in points]
            for (ax, ay), (bx, by) in itertools.pairwise(spots):
                for x, y in _segment(ax, ay, bx, by):
                    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):  # 2 px wide
                        put(x + dx, y + dy, color)
            for x, y in spots:  # a 3 × 3 dot at each measurement
                for dx in (-1, 0, 1):
                    for dy in (-1, 0, 1):
                        put(x + dx, y + dy, color)
    path.write_bytes(png_bytes(width, height, [bytes(row) for row in pixels]))


def _segment(ax: int, ay: int, bx: int, by: int) -> list[tuple[int, int]]:
    """The pixels of the line from ``(ax, ay)`` to ``(bx, by)`` (Bresenham)."""
    out = []
    dx, dy = abs(bx - ax), -abs(by - ay)
    sx, sy = (1 if ax < bx else -1), (1 if ay < by else -1)
    err = dx + dy
    x, y = ax, ay
    for _ in range(dx - dy + 1):  # at most that many pixels
        out.append((x, y))
        if x == bx and y == by:
            break
        e2 = 2 * err
        if e2 >= dy:
            err += dy
            x += sx
        if e2 <= dx:
            err += dx
            y += sy
    return out


# -- the aligned model, evaluated while the run goes ---------------------------------------


@dataclass
class Curve:
    """Validation loss over the run's seconds: ``(seconds since start, loss)``."""

    label: str
    points: list[tuple[float, float]] = field(default_factory=list)

    def text(self) -> str:
        if not self.points:
            return "—"
        first, last = self.points[0][1], self.points[-1][1]
        return f"{first:.3f} → {last:.3f}" if len(self.points) > 1 else f"{last:.3f}"


def run_algorithm(box: Mailbox) -> str | None:
    """The name of the algorithm the run's manifest records (None before the manifest)."""
    from gradientmail import wire
    from gradientmail.coord.threads import run_coroutine

    data = run_coroutine(box.get(wire.MANIFEST))
    if data is None:
        return None
    return str(wire.decode_manifest(wire.MANIFEST, data).algorithm.get("name", ""))


class AlignedEval(threading.Thread):
    """Evaluates the run's aligned model every ``interval`` seconds, when ``version()`` (the
    watcher's rounds committed) changed since the last time; :meth:`finish` stops it and
    evaluates once more, after the nodes' last commits."""

    def __init__(
        self,
        url: str,
        settings: LmSettings,
        started: float,
        version: Callable[[], int | None],
        interval: float = 3.0,
    ) -> None:
        super().__init__(name="gradientmail-aligned-eval", daemon=True)
        self.url = url
        self.settings = settings
        self.started = started
        self.version = version
        self.interval = interval
        self.curve = Curve("aligned model")
        self.rounds: dict[int, int] = {}
        self.algorithm: str | None = None  # the manifest's algorithm name, once read
        self.error: str | None = None
        self._seen: int | None = None
        self._halt = threading.Event()
        self._model: Any = None
        self._val: Any = None
        self._box: Any = None

    def _setup(self) -> None:
        import torch

        from gradientmail import _lm
        from gradientmail.cli._common import mailbox_for
        from gradientmail.node import _lm_model

        torch.set_num_threads(1)  # the nodes have the cores; this is one small forward pass
        _, self._val = _lm.cached_corpus(**self.settings.corpus())
        self._model = _lm_model(self.settings)
        self._box = mailbox_for(self.url)

    def run(self) -> None:
        try:
            self._setup()
        except Exception as exc:
            self.error = f"cannot evaluate the aligned model: {exc}"
            log.warning("%s", self.error, exc_info=True)
            return
        while not self._halt.is_set():
            version = self.version()
            if version is not None and version != self._seen:
                self._evaluate(version)
            self._halt.wait(self.interval)

    def _evaluate(self, version: int | None) -> None:
        import gradientmail as gm
        from gradientmail import _lm

        try:
            rounds = gm.align(self._model, mailbox=self._box, timeout=10)
        except Exception as exc:  # a transient store error: the next tick tries again
            self.error = f"aligned model: {exc}"
            log.info("%s", self.error)
            return
        loss = _lm.evaluate(self._model, self._val)
        self.curve.points.append((time.monotonic() - self.started, loss))
        self.rounds, self._seen, self.error = rounds, version, None
        if self.algorithm is None:
            self._read_algorithm()

    def _read_algorithm(self) -> None:
        """The run's algorithm (align just loaded the run: its manifest is there); a
        failure leaves it unknown until the next evaluation."""
        try:
            self.algorithm = run_algorithm(self._box)
        except Exception as exc:
            log.info("aligned model: cannot read the run's algorithm: %s", exc)

    def stop(self) -> None:
        """Stop evaluating (the run ended or failed); an evaluation under way completes."""
        self._halt.set()
        if self.is_alive():
            self.join(timeout=60)

    def model(self) -> Any:
        """The aligned model as last evaluated (a :class:`gradientmail._lm.TinyLM`)."""
        if self._model is None:
            raise RuntimeError("the aligned model was never loaded")
        return self._model

    def finish(self) -> None:
        """Stop, then evaluate the final state (when the thread could set up at all)."""
        self.stop()
        if self._model is not None:
            self._evaluate(None)

    def line(self) -> Text:
        """The table's line: the curve so far as a sparkline, first → newest."""
        if self.error and not self.curve.points:
            return Text(self.error, style="yellow")
        points = self.curve.points
        if not points:
            return Text("aligned model: validation loss — (waiting for the first commit)")
        newest = max(self.rounds.values(), default=0)
        what = "group round" if self.algorithm == "moshpit" else "round"
        return Text.assemble(
            "aligned model: validation loss ",
            (self.curve.text(), "bold"),
            " nats/byte  ",
            (sparkline([v for _, v in points[-40:]]), "cyan"),
            f"  ({len(points)} evaluations, newest at {what} {newest})",
        )


# -- the end of a run ----------------------------------------------------------------------


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


def curve_notes(algorithm: str | None) -> tuple[str, str]:
    """What the two curves show, for the run's ``algorithm`` (the manifest's name): the
    aligned model's, then a node's own model's."""
    if algorithm == "moshpit":  # no run-wide commits: groups average among themselves
        return (
            "the average of the newest group round's commits, what `gradientmail align` loads",
            "its own model: its shard between syncs, its group's average at each sync",
        )
    return (
        "the newest commit of every fragment, what `gradientmail align` loads",
        "its own model: its shard between syncs, each fragment's commit at its syncs",
    )


def finish(
    console: Console,
    workdir: Path,
    evaluator: AlignedEval,
    node: Curve,
) -> None:
    """Print both curves and a few generated lines; write ``curves.json`` and
    ``loss.png`` into the run folder."""
    evaluator.finish()
    aligned = evaluator.curve
    if not aligned.points:
        console.print(f"[yellow]no evaluation of the aligned model[/]: {evaluator.error}")
        return
    values = [v for c in (aligned, node) for _, v in c.points]
    lo, hi = min(values), max(values)
    end = max(t for c in (aligned, node) for t, _ in c.points)
    width = 48
    console.print(
        f"\nvalidation loss, nats/byte ({evaluator.settings.eval_windows} held-out windows of "
        f"{evaluator.settings.context + 1} bytes), over the run's {end:.0f} s on one scale:"
    )
    pad = max(len(aligned.label), len(node.label))
    for curve, note in zip((aligned, node), curve_notes(evaluator.algorithm), strict=True):
        spark = sparkline(binned(curve.points, width, end), lo=lo, hi=hi)
        console.print(f"  {escape(curve.label):<{pad}}  {curve.text():<15} {spark}")
        console.print(f"  {'':<{pad}}  [dim]{escape(note)}[/]")
    record = {
        "unit": "validation loss, nats per byte; x: seconds since the run started",
        "curves": [
            {"label": c.label, "points": [[round(t, 3), v] for t, v in c.points]}
            for c in (aligned, node)
        ],
        "colors": {aligned.label: "blue", node.label: "orange"},
        "rounds": {str(k): v for k, v in sorted(evaluator.rounds.items())},
    }
    (workdir / "curves.json").write_text(json.dumps(record, indent=2) + "\n")
    png = workdir / "loss.png"
    plot_png(png, [(aligned.points, ALIGNED_COLOR), (node.points, NODE_COLOR)])
    console.print(
        f"  curves: {escape(str(png))} (blue: aligned model, orange: {escape(node.label)})"
    )
    _generate(console, evaluator)


def _generate(console: Console, evaluator: AlignedEval) -> None:
    """Three fixed prompts, 60 bytes each at temperature 0.4 (seeded: the same model writes
    the same lines); at most two non-blank lines of each are shown."""
    from gradientmail import _lm

    temperature = 0.4
    console.print(
        f"\nthe aligned model continues each prompt (bold; temperature {temperature}). A small "
        "model after a short run writes Python's shape more than its sense:"
    )
    for i, prompt in enumerate(PROMPTS):
        text = _lm.generate(evaluator.model(), prompt, 60, temperature=temperature, seed=i)
        decoded = (prompt + text).decode("utf-8", errors="replace").expandtabs(4)
        lines = [line.rstrip() for line in decoded.splitlines() if line.strip()][:2]
        head = prompt.decode()
        for j, line in enumerate(lines):
            shown = "".join(c if c.isprintable() else "\ufffd" for c in line)
            if j == 0:
                console.print(f"  [bold]{escape(head)}[/]{escape(shown[len(head) :])}")
            else:
                console.print(f"  {escape(shown)}")
