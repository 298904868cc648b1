"""What every benchmark of the suite shares: timing repeated runs, tables with the ratio to a
reference measured in the same run, targets, progress on stderr, and the JSON record.

A benchmark module has a docstring (what it measures, against which reference), a ``NAME``
and a ``run(ctx) -> Report``. It builds its tables from :class:`Stats` (median and min–max
over repetitions) and states each target with :meth:`Report.target`.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
GB = 1e9

_T0 = time.monotonic()


def progress(message: str) -> None:
    """One line of progress on stderr, with the seconds since the suite started."""
    print(f"  [{time.monotonic() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


# -- statistics ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stats:
    """Median and min–max of repeated measurements (seconds, bytes, ... as measured)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, samples: Iterable[float]) -> Stats:
        values = [float(v) for v in samples if not math.isnan(float(v))]
        if not values:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def scaled(self, factor: float) -> Stats:
        return Stats(self.median * factor, self.min * factor, self.max * factor, self.n)

    def rate(self, amount: float) -> Stats:
        """``amount / seconds``: the median rate, and the min–max rates (from max–min times)."""
        if self.n == 0 or self.median <= 0:
            return Stats(math.nan, math.nan, math.nan, 0)
        return Stats(amount / self.median, amount / self.max, amount / self.min, self.n)


def median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN (NaN when none)."""
    return Stats.of(values).median


def mean(values: Iterable[Any]) -> float:
    """The mean of the values that are numbers and not NaN (NaN when none)."""
    good = [float(v) for v in values if isinstance(v, int | float) and not math.isnan(v)]
    return sum(good) / len(good) if good else math.nan


def measure(
    fn: Callable[[], object],
    reps: int,
    *,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
) -> Stats:
    """Seconds per call of ``fn`` over ``reps`` timed calls after ``warmup`` untimed ones;
    ``setup`` runs untimed before each call."""
    samples = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        if i >= warmup:
            samples.append(took)
    return Stats.of(samples)


def measure_interleaved(
    fns: dict[str, Callable[[], object]], reps: int, *, warmup: int = 1
) -> dict[str, Stats]:
    """Like :func:`measure` for several functions, taking turns within each repetition so
    that drift in the machine's load hits them all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(warmup + reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            if i >= warmup:
                samples[name].append(took)
    return {name: Stats.of(values) for name, values in samples.items()}


# -- formatting ------------------------------------------------------------------------------


def secs(s: float) -> str:
    if math.isnan(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def spread(st: Stats, show: Callable[[float], str] = lambda v: f"{v:.0f}", unit: str = "") -> str:
    """``median (min–max)``: each value through ``show``, ``unit`` after the median; the
    median alone when there is one value or all are equal."""
    if st.n == 0:
        return "-"
    if st.n == 1 or st.min == st.max:
        return f"{show(st.median)}{unit}"
    return f"{show(st.median)}{unit} ({show(st.min)}–{show(st.max)})"


def secs_range(st: Stats) -> str:
    """``median (min–max)`` of seconds."""
    return spread(st, secs)


def size(n: float) -> str:
    if math.isnan(n):
        return "-"
    if n >= 1024 * MIB:
        return f"{n / 1024 / MIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def gbps(st: Stats) -> str:
    """A rate in bytes/s as ``median GB/s (min–max)``."""
    return spread(st, lambda v: f"{v / GB:.2f}", " GB/s")


def ratio(value: float, reference: float, digits: int = 2) -> str:
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return "-"
    return f"{value / reference:.{digits}f}x"


def pct(value: float, reference: float) -> str:
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return "-"
    return f"{100 * value / reference:.1f}%"


def change(value: float, reference: float) -> str:
    """``value`` against ``reference`` as a signed percentage: ``+1.23%``."""
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return "-"
    return f"{100 * (value / reference - 1):+.2f}%"


def num(value: Any, fmt: str = "{:.0f}") -> str:
    """A number that may be missing (None, NaN: ``n/a``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return fmt.format(value)


def count(text: str) -> int:
    """``10M`` -> 10_000_000."""
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    return int(float(number) * scale)


# -- tables and reports ----------------------------------------------------------------------


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [len(h) for h in self.header]
        for row in self.rows:
            for i, cell in enumerate(row):
                widths[i] = max(widths[i], len(cell))
        lines = [f"### {self.title}", ""]
        lines.append(
            "| " + " | ".join(h.ljust(w) for h, w in zip(self.header, widths, strict=True)) + " |"
        )
        lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for row in self.rows:
            cells = row + [""] * (len(widths) - len(row))
            lines.append(
                "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
            )
        if self.note:
            lines += ["", self.note]
        return "\n".join(lines)


@dataclass
class Target:
    name: str
    measured: str
    goal: str
    met: bool | None  # None: not measured (skipped)
    why: str = ""

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "not measured"}[self.met]


@dataclass
class Report:
    name: str
    title: str
    reference: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers for the JSON record
    seconds: float = 0.0
    error: str | None = None

    def table(self, title: str, header: Sequence[str], note: str = "") -> Table:
        t = Table(title, list(header), note=note)
        self.tables.append(t)
        return t

    def target(
        self, name: str, measured: str, goal: str, met: bool | None, why: str = ""
    ) -> Target:
        t = Target(name, measured, goal, met, why)
        self.targets.append(t)
        return t

    def render(self) -> str:
        parts = [f"## {self.title}", "", f"Reference: {self.reference}"]
        if self.error:
            parts += ["", f"ERROR: {self.error}"]
        for t in self.tables:
            parts += ["", t.render()]
        if self.targets:
            parts += ["", "Targets:", ""]
            for tg in self.targets:
                line = f"- [{tg.verdict}] {tg.name}: {tg.measured} (target {tg.goal})"
                if tg.why:
                    line += f". {tg.why}"
                parts.append(line)
        if self.notes:
            parts += [""] + [f"- {n}" for n in self.notes]
        parts += ["", f"({self.seconds:.0f} s)"]
        return "\n".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "reference": self.reference,
            "seconds": round(self.seconds, 2),
            "error": self.error,
            "targets": [asdict(t) | {"verdict": t.verdict} for t in self.targets],
            "tables": [asdict(t) for t in self.tables],
            "notes": self.notes,
            "data": self.data,
        }


# -- the run's context -----------------------------------------------------------------------


@dataclass
class Context:
    """What a benchmark gets: the size preset, a scratch directory, and a cache that lets
    benchmarks share an expensive measurement (the hivemind reference, the two-process run)."""

    quick: bool
    large: bool
    workdir: Path
    options: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)

    def pick(self, default: Any, quick: Any, large: Any = None) -> Any:
        """The value for the preset in force: ``--quick``, ``--large``, or the default."""
        if self.quick:
            return quick
        if self.large and large is not None:
            return large
        return default


def machine() -> dict[str, Any]:
    """The machine and the load on it, for the JSON record and the header."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = math.nan
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover
        pass
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["git"] = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    return info


def describe(info: dict[str, Any]) -> str:
    load = ", ".join(f"{x:.2f}" for x in info.get("load_average", []))
    return (
        f"{info['cpu']}, {info['cores']} cores, {size(info['memory_bytes'])} RAM; "
        f"Python {info['python']}, torch {info.get('torch', '?')} "
        f"({info.get('torch_threads', '?')} threads); git {info.get('git', '?')}; "
        f"load average {load}"
    )


T = TypeVar("T")


def overridden(config: T, options: dict[str, Any] | None, choices: dict[str, Sequence[str]]) -> T:
    """``config`` (a dataclass) with a benchmark's ``ctx.options`` overrides applied (lists
    become tuples); every override named in ``choices`` must pick among its values."""
    import dataclasses

    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in (options or {}).items()}
    config = dataclasses.replace(config, **overrides)  # type: ignore[type-var]
    for key, allowed in choices.items():
        unknown = [x for x in getattr(config, key) if x not in allowed]
        if unknown:
            raise ValueError(f"unknown {key} {unknown}; choose from {list(allowed)}")
    return config


def guarded(index: int, barrier: Any, queue: Any, body: Callable[[], Any]) -> None:
    """A benchmark learner process's body: its result (when not None) goes on ``queue``; a
    failure aborts ``barrier`` (so the others do not wait for this one) and goes on
    ``queue`` as ``{"index", "error", "traceback"}``."""
    import traceback

    try:
        result = body()
        if result is not None:
            queue.put(result)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            barrier.abort()
        queue.put(
            {
                "index": index,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )


def spec_table(
    report: Report,
    title: str,
    columns: Sequence[tuple[str, Callable[[Any], object]]],
    items: Iterable[Any],
    note: str = "",
) -> Table:
    """A table of ``report`` with one row per item and one column per ``(header, cell)``."""
    table = report.table(title, [header for header, _ in columns], note=note)
    for item in items:
        table.add(*(cell(item) for _, cell in columns))
    return table


def alone(
    run: Callable[[Context], Report],
    *,
    quick: bool = False,
    large: bool = False,
    options: dict[str, Any] | None = None,
    markdown: Path | None = None,
    json_path: Path | None = None,
    header: bool = True,
) -> Report:
    """One benchmark on its own (``python -m bench.<module>``), in a scratch directory: its
    report printed under the machine's description (``header``: torch's import and git
    take seconds), written as Markdown to ``markdown`` and as ``{"machine", "report"}`` JSON
    to ``json_path`` when given."""
    import json
    import tempfile

    info = machine() if header or json_path else {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gm-bench-") as tmp:
        report = run(Context(quick, large, Path(tmp), options or {}))
    report.seconds = time.monotonic() - started
    text = f"{report.render()}\n"
    if header:
        info["load_average_after"] = list(os.getloadavg())
        load = ", ".join(f"{x:.2f}" for x in info["load_average_after"])
        text = f"Machine: {describe(info)}; load average at the end {load}\n\n{text}"
    print(text, flush=True)
    for path, content in ((markdown, text), (json_path, None)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            record = {"machine": info, "report": report.to_json()}
            path.write_text(content or json.dumps(record, indent=2, default=repr) + "\n")
    return report


def fields(obj: object, names: str) -> dict[str, Any]:
    """``{name: obj.name}`` for each of the space-separated ``names`` (a JSON record's
    fields that carry an attribute's name)."""
    return {name: getattr(obj, name) for name in names.split()}


def least_squares(pts: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    """The line ``y = intercept + slope x`` through ``pts`` by least squares: ``(slope,
    intercept, r2)``; NaN with fewer than 2 points or one x."""
    n = len(pts)
    if n < 2:
        return math.nan, math.nan, math.nan
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    syy = sum((y - my) ** 2 for _, y in pts)
    if sxx == 0:
        return math.nan, math.nan, math.nan
    slope = sxy / sxx
    return slope, my - slope * mx, 1.0 if syy == 0 else sxy * sxy / (sxx * syy)


def save_figure(fig: Any, path: Path) -> str:
    """Write a matplotlib figure to ``path`` as PNG and close it; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    progress(f"plot: {path}")
    return str(path)
