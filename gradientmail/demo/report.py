"""What ``gradientmail run`` shows of the built-in language model: the aligned model's
validation loss while the run goes, and at the end its curve beside one node's, a PNG of
both in the run folder, and a few lines the aligned model writes.

**Who evaluates the aligned model.** The aligned model is what :func:`gradientmail.align`
loads: the newest commit of every fragment, or for a Moshpit run (no run-wide commits) the
average of the newest group round's commits. :class:`AlignedEval` evaluates it in the
``gradientmail run`` process, on a thread, on the same fixed validation windows the nodes
know (:func:`gradientmail.demo.lm.cached_corpus`): at most every ``interval`` seconds and only
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

The terminal sparkline (:func:`sparkline`) and the PNG (:func:`gradientmail.demo.plot.plot_png`:
matplotlib when installed, else a small encoder of its own) are torch-free; torch is
imported only on the evaluator's thread and in :func:`finish`, when the built-in LM runs.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from gradientmail.demo.plot import plot_png
from gradientmail.settings import exchange_kind

if TYPE_CHECKING:
    from gradientmail.demo.node import LmSettings
    from gradientmail.mailbox import Mailbox

__all__ = [
    "AlignedEval",
    "Curve",
    "binned",
    "curve_notes",
    "finish",
    "run_algorithm",
    "sparkline",
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

        from gradientmail.cli._common import mailbox_for
        from gradientmail.demo import lm
        from gradientmail.demo.node import lm_model

        torch.set_num_threads(1)  # the nodes have the cores; this is one small forward pass
        _, self._val = lm.cached_corpus(**self.settings.corpus())
        self._model = lm_model(self.settings)
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
        from gradientmail.demo import lm

        try:
            rounds = gm.align(self._model, mailbox=self._box, timeout=10)
        except Exception as exc:  # a transient store error: the next tick tries again
            self.error = f"aligned model: {exc}"
            log.info("%s", self.error)
            return
        loss = lm.evaluate(self._model, self._val)
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
        """The aligned model as last evaluated (a :class:`gradientmail.demo.lm.TinyLM`)."""
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
        what = "group round" if _groups(self.algorithm) else "round"
        return Text.assemble(
            "aligned model: validation loss ",
            (self.curve.text(), "bold"),
            " nats/byte  ",
            (sparkline([v for _, v in points[-40:]]), "cyan"),
            f"  ({len(points)} evaluations, newest at {what} {newest})",
        )


def _groups(algorithm: str | None) -> bool:
    """Whether the run's algorithm (the manifest's name) averages in groups (no run-wide
    commits); an unknown or missing name reads as run-wide rounds."""
    return exchange_kind(algorithm) == "groups"


# -- the end of a run ----------------------------------------------------------------------


def curve_notes(algorithm: str | None) -> tuple[str, str]:
    """What the two curves show, for the run's ``algorithm`` (the manifest's name): the
    aligned model's, then a node's own model's."""
    if _groups(algorithm):  # no run-wide commits: groups average among themselves
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
    plot_png(
        png, [(aligned.points, ALIGNED_COLOR, aligned.label), (node.points, NODE_COLOR, node.label)]
    )
    console.print(
        f"  curves: {escape(str(png))} (blue: aligned model, orange: {escape(node.label)})"
    )
    _generate(console, evaluator)


def _generate(console: Console, evaluator: AlignedEval) -> None:
    """Three fixed prompts, 60 bytes each at temperature 0.4 (seeded: the same model writes
    the same lines); at most two non-blank lines of each are shown."""
    from gradientmail.demo import lm

    temperature = 0.4
    console.print(
        f"\nthe aligned model continues each prompt (bold; temperature {temperature}). A small "
        "model after a short run writes Python's shape more than its sense:"
    )
    for i, prompt in enumerate(PROMPTS):
        text = lm.generate(evaluator.model(), prompt, 60, temperature=temperature, seed=i)
        decoded = (prompt + text).decode("utf-8", errors="replace").expandtabs(4)
        lines = [line.rstrip() for line in decoded.splitlines() if line.strip()][:2]
        head = prompt.decode()
        for j, line in enumerate(lines):
            shown = "".join(c if c.isprintable() else "\ufffd" for c in line)
            if j == 0:
                console.print(f"  [bold]{escape(head)}[/]{escape(shown[len(head) :])}")
            else:
                console.print(f"  {escape(shown)}")
