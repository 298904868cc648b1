"""Benchmark 8 — training quality on real text: does a GradientMail run learn the model the
algorithm promises? Against data-parallel training and DiLoCo computed in one process with
zero latency, in the same run.

A small byte-level causal transformer LM (``_lm.py``) trains on the Python standard
library's own ``.py`` sources: 5% held out for validation (mixing all sources), the rest in
M = 4 non-IID shards by top-level package (the test suite; tools, GUIs and codec tables;
other packages; single-file modules). Every arm sees the same samples, the same total T:

- ``ddp``: one process, batch M·B for T/M steps (synchronous data-parallel over M workers);
- ``reference``: DiLoCo in one process with zero latency: M model copies, the outer Nesterov
  step through ``gm.DiLoCo.combine`` itself, Streaming DiLoCo's fragment schedule as the
  library has it; at the end every fragment contributes its steps since its last sync point;
- ``diloco``: M learner processes through ``gm.Session`` on a ``gm.FileMailbox`` (a
  ``gm.Barrier`` until all joined, ``quorum_size=M``), ``DiLoCo(sync_every=H, fragments=F)``
  for each H and F; evaluated as a user would: ``gm.align`` in a separate process after the
  learners finished, and the loss curve from the run's commits;
- ``diloco-fast``: the same with a tiny model whose steps take a few ms (its own ``ddp``,
  ``reference`` and ``reference-late`` on that model);
- ``diloco-s3``: the best ``diloco`` setting again on SeaweedFS;
- ``reference-late``: the reference with each outer step applied N inner steps late, N the
  commit lag the ``diloco`` arm measured, the local progress made meanwhile kept;
- ``solo-average``: the M learners never syncing, averaged once at the end.

On request (``compression_arms``, or their names or ``compression`` among ``arms``), the
compressed contributions: ``diloco-topk-*``, ``diloco-bf16``, ``diloco-int8`` (``gm.DiLoCo``
with ``compression=gm.TopK(...)``, ``gm.Cast("bfloat16")``, ``gm.Quantize(bits=8)``) and
``sparseloco-2%``, ``sparseloco-1%`` (``gm.SparseLoCo``), each run like the ``diloco`` arm of
the smallest H and F (learner processes, file mailbox, ``gm.align``), and reported against
it: loss, and bytes per learner per round applied.

Where ``gm.Session`` has an ``overlap`` setting, the ``diloco`` arms run with its default,
and one more arm (H = the smallest, F = 1) on the other side of it: ``overlap=0`` (must
match ``reference``) where the default overlaps, else ``overlap=H/5`` (must match
``reference-late``; its gap to ``reference`` is the price of overlap).

    .venv/bin/python -m bench quality [--quick | --large]
    .venv/bin/python -m bench.quality --quick --arms diloco-H25-F1,compression
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench import _lm
from bench._procs import Job, JobFailed, child_env, run_pool, run_together, seaweedfs_specs

NAME = "quality"
M = _lm.LEARNERS


# -- presets ---------------------------------------------------------------------------------


def sizes_for(ctx: h.Context) -> _lm.Sizes:
    """The preset's sizes; ``ctx.options["quality"]["sizes"]`` (tests) overrides them."""
    given = ctx.options.get("quality", {}).get("sizes")
    if given is not None:
        return given if isinstance(given, _lm.Sizes) else _lm.Sizes.from_json(given)
    cores = os.cpu_count() or 2
    tiny = _lm.ModelSize(d_model=32, layers=1, heads=2)
    if ctx.quick:
        return _lm.Sizes(
            model=_lm.ModelSize(d_model=64, layers=2, heads=4),
            fast_model=tiny,
            batch=4,
            steps=300,
            fast_steps=300,
            checkpoints=6,
            eval_windows=256,
            sync_every=(25,),
            fragments=(1, 4),
        )
    if ctx.large:
        return _lm.Sizes(
            model=_lm.ModelSize(d_model=192, layers=4, heads=6),
            fast_model=tiny,
            batch=8,
            steps=2400,
            fast_steps=2400,
            lr=1e-3,
            checkpoints=10,
            eval_windows=1024,
            threads=max(1, cores // M),
        )
    return _lm.Sizes(
        model=_lm.ModelSize(d_model=128, layers=2, heads=4),
        fast_model=tiny,
        batch=4,
        steps=800,
        fast_steps=800,
    )


# -- compressed contributions ----------------------------------------------------------------


def _topk(density: float, bits: int) -> dict[str, Any]:
    return {"name": "diloco", "compression": {"name": "topk", "density": density, "bits": bits}}


COMPRESSION_ARMS: dict[str, dict[str, Any]] = {
    # In the order they run: the ones that matter most first.
    "sparseloco-2%": {"name": "sparseloco"},  # its defaults: TopK 2%, 2 bits, outer_lr 1
    "diloco-topk-2%-2b": _topk(0.02, 2),
    "diloco-bf16": {"name": "diloco", "compression": {"name": "cast", "dtype": "bfloat16"}},
    "diloco-int8": {"name": "diloco", "compression": {"name": "quantize", "bits": 8}},
    "sparseloco-1%": {
        "name": "sparseloco",
        "compression": {"name": "topk", "density": 0.01, "bits": 2},
    },
    "diloco-topk-1%-2b": _topk(0.01, 2),
    "diloco-topk-5%-2b": _topk(0.05, 2),
    "diloco-topk-2%-4b": _topk(0.02, 4),
    "diloco-topk-2%-8b": _topk(0.02, 8),
}
"""Arm name -> the learners' algorithm (``_quality_worker.make_algorithm``): everything else
is the ``diloco`` arm's (H, F, learners, data, steps, file mailbox)."""


def describe_algorithm(settings: Mapping[str, Any] | None) -> str:
    """An ``Algorithm.settings()`` (what a learner reports) in words."""
    if not settings:
        return "-"
    c = settings.get("compression")
    if not c:
        words = "dense (parameters)"
    elif c["name"] == "topk":
        words = f"TopK {100 * c['density']:g}%, {c['bits']} bits"
    elif c["name"] == "cast":
        words = f"Cast {c['dtype']}"
    elif c["name"] == "quantize":
        words = f"Quantize {c['bits']} bits"
    else:
        words = str(c)
    if settings.get("name") == "sparseloco":
        words = (
            f"SparseLoCo: {words}, outer_lr {settings['outer_lr']:g}, "
            f"error_decay {settings['error_decay']:g}"
        )
    elif c:
        words = f"DiLoCo: {words}"
    return words


# -- arms ------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One row of the report."""

    key: str
    arm: str  # ddp, reference, diloco, ...
    family: str  # main or fast
    sync_every: int | None = None
    fragments: int | None = None
    overlap: int | None = None  # None: the library's default (or no such setting)
    late: int | None = None
    mixing: float | None = None  # Streaming DiLoCo's blend of a late commit (None: rebase)
    backend: str = ""
    algorithm: dict[str, Any] | None = None  # compressed and Moshpit arms: the learners'
    learners: int | None = None  # learner processes or in-process shards (None: M)
    described: str | None = None  # the setting column, where given (the Moshpit arms)
    final_loss: float = math.nan
    learner_losses: list[float] = field(default_factory=list)  # each learner's own model
    curve: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = math.nan
    error: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def setting(self) -> str:
        if self.described is not None:
            return self.described
        parts = []
        if self.sync_every is not None:
            parts.append(f"H={self.sync_every}")
        if self.fragments is not None:
            parts.append(f"F={self.fragments}")
        if self.overlap is not None:
            parts.append(f"overlap={self.overlap}")
        if self.mixing is not None:
            parts.append(f"mixing={self.mixing}")
        if self.late is not None:
            parts.append(f"N={self.late}")
        for key, value in sorted(((self.algorithm or {}).get("settings") or {}).items()):
            parts.append(f"{key}={value:g}")
        if self.backend:
            parts.append(self.backend)
        return " ".join(parts) or "-"

    @property
    def compressed(self) -> bool:
        """A compressed-contributions arm (``COMPRESSION_ARMS``)."""
        return self.algorithm is not None

    @property
    def gradientmail(self) -> bool:
        """Learner processes through ``gm.Session`` (diloco*, compressed arms)."""
        return self.arm.startswith("diloco") or self.compressed

    def label(self) -> str:
        model = " (tiny)" if self.family == "fast" else ""
        setting = self.setting
        return f"{self.arm}{model}" + ("" if setting == "-" else f" {setting}")


class Bench:
    def __init__(self, ctx: h.Context, sizes: _lm.Sizes) -> None:
        self.ctx = ctx
        self.sizes = sizes
        self.dir = ctx.workdir / f"quality-{uuid.uuid4().hex[:6]}"
        self.dir.mkdir(parents=True)
        self.data = self.dir / "data.pt"
        self.env = child_env(sizes.threads)
        self.parallel = max(1, (os.cpu_count() or 2) // sizes.threads)
        self.arms: dict[str, Arm] = {}
        self.params: dict[str, Path] = {}  # arm key -> its final parameters
        self.timeout_scale = float(ctx.options.get("quality", {}).get("timeout_scale", 1.0))

    # Timeouts: generous multiples of the expected time on a loaded 2-core machine; more
    # learner processes than M share the cores.
    def _train_timeout(self, family: str, learners: int | None = None) -> float:
        _, steps = self.sizes.family(family)
        share = 1.0 if learners is None else max(1.0, learners / self.parallel)
        return self.timeout_scale * (300 + 1.5 * steps * share)

    def inprocess_job(
        self,
        key: str,
        arm: str,
        family: str,
        sync_every: int = 25,
        fragments: int = 1,
        late: int = 0,
        learners: int | None = None,
    ) -> Job:
        """An arm computed in one process; ``learners``: ``ddp`` or ``solo-average`` over
        that many shards (``_quality_worker.inprocess_n``)."""
        save = self.dir / f"{key}.params.pt"
        self.params[key] = save
        spec = {
            "mode": "inprocess",
            "sizes": self.sizes.to_json(),
            "data": str(self.data),
            "arm": arm,
            "family": family,
            "sync_every": sync_every,
            "fragments": fragments,
            "late": late,
            "tail": True,
            "save": str(save),
            **({"learners": learners} if learners is not None else {}),
        }
        return Job(key, spec, self._train_timeout(family) * ((learners or M) + 1), self.dir)

    def record_inprocess(self, job: Job, arm: Arm) -> None:
        self.arms[arm.key] = arm
        try:
            value = job.value()
        except JobFailed as exc:
            arm.error = str(exc).splitlines()[0]
            h.progress(f"{arm.label()}: FAILED {exc}")
            return
        arm.final_loss = float(value["final_loss"])
        arm.curve = [(int(x), float(y)) for x, y in value["curve"]]
        arm.wall_s = float(value["wall_s"])
        arm.learner_losses = [float(x) for x in value.get("learner_losses") or []]
        arm.data = {
            k: value[k]
            for k in ("train_loss", "sync_points", "rounds", "extra", "gradientmail_file")
        }
        h.progress(f"{arm.label()}: validation loss {arm.final_loss:.4f} ({arm.wall_s:.0f} s)")

    def run_inprocess(self, specs: Sequence[tuple[Arm, Job]]) -> None:
        by_key = {job.name: arm for arm, job in specs}
        for arm, _ in specs:
            h.progress(f"{arm.label()}: queued ({self.parallel} at a time)")
        run_pool(
            [job for _, job in specs],
            self.parallel,
            self.env,
            lambda job: self.record_inprocess(job, by_key[job.name]),
        )

    def run_learners(
        self,
        key: str,
        label: str,
        learner: Callable[[int], dict[str, Any]],
        evaluation: dict[str, Any],
        timeout: float,
    ) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
        """Learner processes (``learner(i)``: learner i's job, one per index it returns
        for ``i`` in ``range(n)``, ``n = evaluation["learners"]`` or M), all at once; then
        ``evaluation`` (``gm.align`` as a user would) in another process. Their results and
        the learners' wall time; :class:`JobFailed` from either."""
        base = {"sizes": self.sizes.to_json(), "data": str(self.data)}
        n = int(evaluation.get("learners", M))
        jobs = [
            Job(f"{key}.learner-{i}", {"mode": "learner", **base, **learner(i)}, timeout, self.dir)
            for i in range(n)
        ]
        h.progress(f"{label}: {n} learner processes")
        t0 = time.monotonic()
        run_together(jobs, self.env, label)
        processes_s = time.monotonic() - t0
        results = [job.value() for job in jobs]
        ev = Job(
            f"{key}.evaluate",
            {"mode": "evaluate", **base, **evaluation},
            self.timeout_scale * 600,
            self.dir,
        )
        run_together([ev], self.env, f"{label} evaluation")
        return results, ev.value(), processes_s

    def run_diloco(
        self,
        arm: Arm,
        box: Callable[[], dict[str, Any]],
        learner: Callable[[int], dict[str, Any]] = lambda i: {},
        evaluation: Mapping[str, Any] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """``arm.learners`` (M) learner processes on the mailbox ``box()`` describes, then
        ``gm.align``; ``learner(i)`` and ``evaluation``: more of their jobs' settings. The
        learners' and the evaluation's results; None when they failed."""
        self.arms[arm.key] = arm
        assert arm.sync_every is not None
        assert arm.fragments is not None
        mailbox = box()
        timeout = self._train_timeout(arm.family, arm.learners) * 2
        save = self.dir / f"{arm.key}.params.pt"
        n = {"learners": arm.learners} if arm.learners is not None else {}
        try:
            results, ev, processes_s = self.run_learners(
                arm.key,
                f"{arm.label()} on {arm.backend}",
                lambda i: {
                    "family": arm.family,
                    "learner": i,
                    "sync_every": arm.sync_every,
                    "fragments": arm.fragments,
                    "overlap": arm.overlap,
                    "mixing": arm.mixing,
                    **({"algorithm": arm.algorithm} if arm.algorithm is not None else {}),
                    "mailbox": mailbox,
                    "timeout": timeout - 60,
                    **n,
                    **learner(i),
                },
                {
                    "family": arm.family,
                    "fragments": arm.fragments,
                    "mailbox": mailbox,
                    "save": str(save),
                    **n,
                    **(evaluation or {}),
                },
                timeout,
            )
        except JobFailed as exc:
            arm.error = str(exc).splitlines()[0]
            arm.data["log"] = str(exc)
            h.progress(f"{arm.label()}: FAILED {exc}")
            return None
        self.params[arm.key] = save
        arm.final_loss = float(ev["final_loss"])
        arm.learner_losses = [float(x) for x in ev.get("learner_losses", [])]
        arm.curve = [(int(x), float(y)) for x, y in ev.get("curve", [])]
        arm.wall_s = max(r["train_s"] + r["close_s"] for r in results)
        arm.data = summarize(results, ev, processes_s)
        h.progress(
            f"{arm.label()}: validation loss {arm.final_loss:.4f}, rounds "
            f"{arm.data['rounds_committed']}/{arm.data['sync_points']}, skipped "
            f"{arm.data['skipped']}, lag {arm.data['lag_steps_median']} steps "
            f"({arm.wall_s:.0f} s)"
        )
        return results, ev

    def file_box(self) -> dict[str, Any]:
        return {"kind": "file", "root": str(self.dir / f"mailbox-{uuid.uuid4().hex[:6]}")}


def summarize(
    learners: Sequence[Mapping[str, Any]], ev: Mapping[str, Any], processes_s: float
) -> dict[str, Any]:
    """A diloco arm's numbers from its learners' and its evaluation's results."""

    def counter(name: str) -> list[Any]:
        return [r["counters"].get(name) for r in learners]

    sync_points = [r["sync_points"] for r in learners]
    counted = [c for c in counter("sync_points") if isinstance(c, int)]
    rounds = ev.get("rounds", [])
    lags = [x for r in learners for x in r["lag_steps"]]
    lag_s = [x for r in learners for x in r["lag_s"] if not math.isnan(x)]
    waited = [w for w in counter("waited_s") if isinstance(w, int | float)]
    waits = [w for w in counter("waits") if isinstance(w, int)]
    skipped = [s for s in counter("skipped_syncs") if isinstance(s, int)]
    samples_trained = sum(r["samples"] for r in learners)
    committed = ev.get("samples_committed") or []
    return {
        "learners": list(learners),
        "evaluation": dict(ev),
        "processes_s": processes_s,
        "sync_points": max(sync_points),
        "sync_points_counter": max(counted) if counted else None,
        "rounds_committed": len(rounds),
        "contributors_per_round": (
            sum(r["contributors"] for r in rounds) / len(rounds) if rounds else math.nan
        ),
        "skipped": sum(skipped) if skipped else None,
        "skipped_total_points": sum(sync_points),
        "step_s_max": max(r["step_s"] for r in learners),
        "step_max_s": max(r["step_max_s"] for r in learners),
        "train_s_max": max(r["train_s"] for r in learners),
        "waited_s": max(waited) if waited else None,
        "waits": sum(waits) if waits else None,
        "lag_steps": lags,
        "lag_steps_median": h.median(lags) if lags else None,
        "lag_steps_max": max(lags) if lags else None,
        "lag_s_median": h.median(lag_s) if lag_s else None,
        "bytes_up": h.mean([r["counters"].get("bytes_up_total", math.nan) for r in learners]),
        "bytes_down": h.mean([r["counters"].get("bytes_down_total", math.nan) for r in learners]),
        "samples_trained": samples_trained,
        # Every round of a fragment accounts for all learners' samples since its last one.
        "samples_in_final": min(committed) if committed else None,
        "samples_committed": committed,
        "failures": [f for r in learners for f in r["failures"]],
        "gradientmail_file": learners[0].get("gradientmail_file"),
        "align_equals_newest": ev.get("align_equals_newest"),
        "curve_error": ev.get("curve_error"),
    }


# -- the run ---------------------------------------------------------------------------------


def effective_overlap(arm: Arm, has_overlap: bool, default: Any) -> Any:
    """The overlap an arm ran with: its own, else the library's default; None where the
    library has no such setting (commits applied whenever they arrive)."""
    if arm.overlap is not None:
        return arm.overlap
    return default if has_overlap else None


def has_mixing() -> bool:
    """Whether ``gm.Session`` takes ``mixing`` (Streaming DiLoCo's blend)."""
    import inspect as _inspect

    import gradientmail as gm

    return "mixing" in _inspect.signature(gm.Session).parameters


def overlap_setting() -> tuple[bool, Any]:
    """Whether ``gm.Session`` takes ``overlap``, and its default."""
    import gradientmail as gm

    params = inspect.signature(gm.Session).parameters
    if "overlap" not in params:
        return False, None
    return True, params["overlap"].default


def library_commit() -> dict[str, Any]:
    """The git commit of the library this bench/ sits beside, and whether it is modified."""
    out: dict[str, Any] = {}
    for key, args in (
        ("commit", ["rev-parse", "HEAD"]),
        ("describe", ["describe", "--always", "--dirty"]),
        ("library_changes", ["status", "--porcelain", "--", "gradientmail"]),
    ):
        try:
            out[key] = subprocess.run(
                ["git", *args], cwd=h.ROOT, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            out[key] = f"unknown: {exc}"
    out["library_modified"] = bool(out.get("library_changes"))
    return out


def run(ctx: h.Context) -> h.Report:
    import torch

    import gradientmail as gm
    from bench import quality_moshpit

    options = ctx.options.get("quality", {})
    chosen = set(options.get("arms") or ())
    moshpit = quality_moshpit.wanted(chosen)
    if moshpit and chosen <= quality_moshpit.ARM_NAMES:  # the Moshpit comparison alone
        report = h.Report(NAME, quality_moshpit.TITLE, quality_moshpit.REFERENCE)
        quality_moshpit.run_arms(ctx, report)
        return report
    sizes = sizes_for(ctx)
    bench = Bench(ctx, sizes)
    report = h.Report(
        NAME,
        "8. Training quality on real text: GradientMail against DiLoCo in one process and DDP",
        "`ddp` (synchronous data-parallel, batch M·B) and `reference` (the same DiLoCo in one "
        "process with zero latency, `gm.DiLoCo.combine` itself), same samples, same run",
    )
    try:
        _run(ctx, bench, report, options, sizes, gm, torch)
    finally:
        if not options.get("keep_workdir"):
            shutil.rmtree(bench.dir, ignore_errors=True)
    if moshpit:  # after the others: a run of its own, N learners on N shards
        quality_moshpit.run_arms(ctx, report)
    return report


def _run(
    ctx: h.Context,
    bench: Bench,
    report: h.Report,
    options: Mapping[str, Any],
    sizes: _lm.Sizes,
    gm: Any,
    torch: Any,
) -> None:
    started = time.monotonic()
    h.progress("reading the standard library's sources")
    corpus = _lm.build_corpus(sizes)
    _lm.save_corpus(corpus, bench.data)
    has_overlap, default_overlap = overlap_setting()
    library = library_commit() | {"gradientmail_file": gm.__file__}
    main_params = _lm.param_count(sizes.model, sizes.context)
    fast_params = _lm.param_count(sizes.fast_model, sizes.context)
    h.progress(
        f"corpus: {corpus.files} files, {corpus.train_bytes / 1e6:.1f} MB train, "
        f"{corpus.val_bytes / 1e6:.2f} MB held out; model {main_params / 1e6:.2f}M params, "
        f"tiny {fast_params / 1e3:.0f}K; gradientmail {gm.__file__} "
        f"({library.get('describe')}); overlap setting: "
        f"{'yes, default ' + repr(default_overlap) if has_overlap else 'n/a'}"
    )
    hs = sorted(sizes.sync_every)
    h_main = hs[0]
    arms_filter: set[str] | None = set(options["arms"]) if options.get("arms") else None

    def wanted(*names: str) -> bool:
        return arms_filter is None or any(name in arms_filter for name in names)

    # 1. The diloco arms, each alone on the machine (M learner processes).
    diloco_arms: list[Arm] = []
    for h_every in hs:
        for f in sorted(sizes.fragments):
            diloco_arms.append(
                Arm(f"diloco-H{h_every}-F{f}", "diloco", "main", h_every, f, backend="file")
            )
    if has_overlap:
        # The other side of the library's default: exact DiLoCo (overlap=0) where the default
        # overlaps, else a run allowed to apply commits up to H/5 steps late (the price of
        # overlap, against reference-late).
        other = 0 if default_overlap != 0 else max(1, h_main // 5)
        diloco_arms.append(
            Arm(f"diloco-H{h_main}-F1-o{other}", "diloco", "main", h_main, 1, other, backend="file")
        )
        if has_mixing():
            # The same overlap with Streaming DiLoCo's blend (param <- a*param + (1-a)*commit)
            # instead of keeping all local progress: the literature's way to cut its price.
            late = max(1, h_main // 5)
            for alpha in (0.5,):
                diloco_arms.append(
                    Arm(
                        f"diloco-H{h_main}-F1-o{late}-a{alpha}",
                        "diloco",
                        "main",
                        h_main,
                        1,
                        late,
                        backend="file",
                        mixing=alpha,
                    )
                )
    if wanted("diloco-fast"):
        diloco_arms.append(Arm("diloco-fast", "diloco-fast", "fast", h_main, 1, backend="file"))
    for arm in diloco_arms:
        if wanted(arm.arm, arm.key):
            bench.run_diloco(arm, bench.file_box)
    # On request: compressed contributions, each like the diloco arm of the smallest H and F,
    # the most telling first; with a time budget, those that would overrun it are skipped.
    budget = options.get("max_seconds")
    last = 0.0
    skipped: list[str] = []
    for arm in compression_arms(options, arms_filter, h_main, min(sizes.fragments)):
        if budget is not None and time.monotonic() - started + last > float(budget):
            skipped.append(arm.arm)
            continue
        t0 = time.monotonic()
        bench.run_diloco(arm, bench.file_box)
        last = time.monotonic() - t0
    if skipped:
        h.progress(f"compressed arms skipped for the time budget: {', '.join(skipped)}")
        report.notes.append(
            f"compressed arms not run (the run would have passed {float(budget or 0):.0f} s): "
            + ", ".join(skipped)
        )
        report.data["compression_skipped"] = skipped

    # 2. The arms computed in one process, a few at a time.
    specs: list[tuple[Arm, Job]] = []

    def add(arm: Arm, job: Job) -> None:
        specs.append((arm, job))

    for family in ("main", "fast"):
        fast = family == "fast"
        suffix = "-fast" if fast else ""
        if wanted("ddp"):
            add(
                Arm(f"ddp{suffix}", "ddp", family),
                bench.inprocess_job(f"ddp{suffix}", "ddp", family),
            )
        configs = [(h_main, 1)]
        if not fast:
            configs += [(x, f) for x in hs for f in sorted(sizes.fragments) if (x, f) != configs[0]]
        for h_every, f in configs:
            key = f"reference{suffix}-H{h_every}-F{f}"
            if wanted("reference"):
                add(
                    Arm(key, "reference", family, h_every, f),
                    bench.inprocess_job(key, "reference", family, h_every, f),
                )
        if not fast and wanted("solo-average"):
            add(
                Arm("solo-average", "solo-average", family),
                bench.inprocess_job("solo-average", "solo-average", family),
            )
    for arm in diloco_arms:
        done = bench.arms.get(arm.key)
        if done is None or done.error or not wanted("reference-late"):
            continue
        if effective_overlap(arm, has_overlap, default_overlap) == 0:
            continue  # exact DiLoCo: reference is its comparison
        if arm.mixing is not None:
            continue  # a blend: reference is its comparison (the price of its overlap)
        lag = done.data.get("lag_steps_median")
        if lag is None:
            continue
        assert arm.sync_every is not None
        assert arm.fragments is not None
        n = min(round(lag), arm.sync_every - 1)
        if n <= 0:
            done.data["late_note"] = "lag 0 steps: reference-late is reference"
            continue
        key = f"reference-late-{arm.key}"
        add(
            Arm(key, "reference-late", arm.family, arm.sync_every, arm.fragments, late=n),
            bench.inprocess_job(
                key, "reference-late", arm.family, arm.sync_every, arm.fragments, n
            ),
        )
    bench.run_inprocess(specs)

    # 3. The best file setting again on SeaweedFS.
    s3_arm: Arm | None = None
    if wanted("diloco-s3") and options.get("s3", True):
        candidates = [
            a
            for a in bench.arms.values()
            if a.arm == "diloco" and not a.error and a.overlap is None and a.mixing is None
        ]
        if candidates:
            best = min(candidates, key=lambda a: a.final_loss)
            s3_arm = Arm(
                "diloco-s3",
                "diloco-s3",
                "main",
                best.sync_every,
                best.fragments,
                backend="seaweedfs",
            )
            try:
                h.progress("starting SeaweedFS")
                with seaweedfs_specs(bench.dir, "quality") as box:
                    bench.run_diloco(s3_arm, box)
                    h.progress("stopping SeaweedFS")
            except Exception as exc:
                s3_arm.error = f"{type(exc).__name__}: {exc}"
                bench.arms[s3_arm.key] = s3_arm
                h.progress(f"diloco-s3: FAILED {s3_arm.error}")

    compare_params(bench, torch)
    build_report(
        report,
        bench,
        corpus,
        sizes,
        library,
        has_overlap,
        default_overlap,
        main_params,
        fast_params,
        time.monotonic() - started,
    )
    png = plot_path(ctx)
    report.data["png"] = write_plot(bench, png, main_params, fast_params)


def compression_arms(
    options: Mapping[str, Any], arms_filter: set[str] | None, h_every: int, fragments: int
) -> list[Arm]:
    """The compressed arms asked for: every one with ``options["compression_arms"]`` or
    ``compression`` among the arms, else those named there (none by default).
    ``options["sparseloco"]`` (``outer_lr``, ``error_decay``) tunes the SparseLoCo arms."""
    every = bool(options.get("compression_arms")) or "compression" in (arms_filter or ())
    tuning = dict(options.get("sparseloco") or {})
    arms = []
    for name, algorithm in COMPRESSION_ARMS.items():
        if not every and name not in (arms_filter or ()):
            continue
        algorithm = dict(algorithm)
        if algorithm["name"] == "sparseloco" and tuning:
            algorithm["settings"] = dict(algorithm.get("settings") or {}) | tuning
        arms.append(
            Arm(
                f"{name}-H{h_every}-F{fragments}",
                name,
                "main",
                h_every,
                fragments,
                backend="file",
                algorithm=algorithm,
            )
        )
    return arms


def compare_params(bench: Bench, torch: Any) -> None:
    """Max |aligned - reference| per GradientMail arm: is it the algorithm, bit for bit?"""
    for arm in bench.arms.values():
        if arm.family and arm.arm.startswith("diloco") and not arm.compressed and not arm.error:
            suffix = "-fast" if arm.family == "fast" else ""
            ref = f"reference{suffix}-H{arm.sync_every}-F{arm.fragments}"
            a, b = bench.params.get(arm.key), bench.params.get(ref)
            if a is None or b is None or not a.exists() or not b.exists():
                continue
            x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
            if set(x) != set(y):
                continue
            diff = max(float((x[n].float() - y[n].float()).abs().max()) for n in x)
            arm.data["max_abs_diff_vs_reference"] = diff
            arm.data["bitwise_reference"] = all(torch.equal(x[n], y[n]) for n in x)
            late = bench.params.get(f"reference-late-{arm.key}")
            if late is not None and late.exists():
                z = torch.load(late, weights_only=True)
                if set(z) == set(x):
                    arm.data["max_abs_diff_vs_reference_late"] = max(
                        float((x[n].float() - z[n].float()).abs().max()) for n in x
                    )
                    arm.data["bitwise_reference_late"] = all(torch.equal(x[n], z[n]) for n in x)


# -- the report ------------------------------------------------------------------------------


SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], low: float, high: float) -> str:
    if not values or math.isnan(low) or high <= low:
        return ""
    out = []
    for v in values:
        i = int((v - low) / (high - low) * (len(SPARK) - 1) + 0.5)
        out.append(SPARK[max(0, min(len(SPARK) - 1, i))])
    return "".join(out)


def build_report(
    report: h.Report,
    bench: Bench,
    corpus: _lm.Corpus,
    sizes: _lm.Sizes,
    library: dict[str, Any],
    has_overlap: bool,
    default_overlap: Any,
    main_params: int,
    fast_params: int,
    seconds: float,
) -> None:
    arms = bench.arms

    def get(key: str) -> Arm | None:
        arm = arms.get(key)
        return arm if arm is not None and not arm.error else None

    data_table = report.table(
        f"Data: the stdlib's .py sources ({corpus.files} files, Python {corpus.python}), "
        f"byte tokens, context {sizes.context}",
        ["learner", "shard (non-IID)", "bytes", "files", "top-level names (largest first)"],
        note=(
            f"Validation: every {_lm.HOLDOUT}th block of {_lm.BLOCK} bytes across all files "
            f"({corpus.val_bytes / 1e6:.2f} MB, "
            f"{100 * corpus.val_bytes / (corpus.val_bytes + corpus.train_bytes):.1f}%), "
            f"{sizes.eval_windows} fixed windows evaluated. Model: {main_params / 1e6:.2f}M "
            f"params (d_model {sizes.model.d_model}, {sizes.model.layers} layers, "
            f"{sizes.model.heads} heads), tiny {fast_params / 1e3:.0f}K (d_model "
            f"{sizes.fast_model.d_model}, {sizes.fast_model.layers} layer); AdamW lr "
            f"{sizes.lr:g}, warm-up 5% then cosine to 10%; B = {sizes.batch} per learner, "
            f"T/M = {sizes.steps} local steps ({sizes.fast_steps} tiny), T = "
            f"{M * sizes.batch * sizes.steps} samples; {sizes.threads} torch thread(s) per "
            "process; seed "
            f"{sizes.seed}."
        ),
    )
    for src in corpus.sources:
        names = src["top_level"]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        data_table.add(
            _lm.learner_id(src["learner"]), src["what"], h.size(src["bytes"]), src["files"], shown
        )

    ddp = {fam: get("ddp" + ("-fast" if fam == "fast" else "")) for fam in ("main", "fast")}

    def reference_of(arm: Arm) -> Arm | None:
        suffix = "-fast" if arm.family == "fast" else ""
        return get(f"reference{suffix}-H{arm.sync_every}-F{arm.fragments}")

    def late_of(arm: Arm) -> Arm | None:
        key = arm.key if arm.arm != "diloco-s3" else _file_twin(arms, arm)
        return get(f"reference-late-{key}") if key else None

    quality = report.table(
        "Validation loss per arm (nats per byte; lower is better)",
        [
            "arm",
            "model",
            "setting",
            "final loss",
            "ratio to ddp",
            "vs reference",
            "vs reference-late",
            "curve",
            "wall (training)",
        ],
        note=(
            "`vs reference`: against DiLoCo in one process with the same H and F; "
            "`vs reference-late`: against the same applied N steps late (N = the arm's "
            "median commit lag). GradientMail arms are evaluated as a user would: `gm.align` "
            "in a separate process after the learners finished. The reference contributes "
            "each fragment's steps since its last sync point at the end (what `close()` is "
            "specified to do). Wall: training time (in-process arms ran "
            f"{bench.parallel} at a time, evaluation excluded; diloco arms: the slowest "
            "learner's training and close)."
        ),
    )
    order = ["ddp", "reference", "diloco", "diloco-s3", "reference-late", "solo-average"]
    ordered = sorted(
        arms.values(),
        key=lambda a: (
            a.family == "fast",
            order.index(a.arm) if a.arm in order else 3.5 if a.compressed else 2,
            a.sync_every or 0,
            a.fragments or 0,
            a.overlap if a.overlap is not None else -1,
        ),
    )
    lows: dict[str, float] = {}
    highs: dict[str, float] = {}
    for a in ordered:  # one scale per model, the first checkpoint left out (it dwarfs the rest)
        for _, y in a.curve[1:] or a.curve:
            lows[a.family] = min(lows.get(a.family, math.inf), y)
            highs[a.family] = max(highs.get(a.family, -math.inf), y)
    rows = []
    for a in ordered:
        ref = reference_of(a) if a.arm != "reference" else None
        late = late_of(a) if a.arm.startswith("diloco") else None
        d = ddp[a.family]
        row = {
            "key": a.key,
            "arm": a.arm,
            "family": a.family,
            "setting": a.setting,
            "sync_every": a.sync_every,
            "fragments": a.fragments,
            "overlap": a.overlap,
            "late": a.late,
            "backend": a.backend,
            **({"algorithm": a.algorithm} if a.compressed else {}),
            "final_loss": a.final_loss,
            "ratio_to_ddp": a.final_loss / d.final_loss if d else None,
            "vs_reference": a.final_loss / ref.final_loss - 1 if ref else None,
            "vs_reference_late": a.final_loss / late.final_loss - 1 if late else None,
            "curve": a.curve,
            "wall_s": a.wall_s,
            "error": a.error,
            "data": {k: v for k, v in a.data.items() if k not in ("learners", "evaluation")},
            "learners": a.data.get("learners"),
            "evaluation": a.data.get("evaluation"),
        }
        rows.append(row)
        if a.error:
            quality.add(a.arm, a.family, a.setting, f"ERROR: {a.error}", "", "", "", "", "")
            continue
        quality.add(
            a.arm + (" (exact)" if a.overlap == 0 else ""),
            f"tiny {fast_params / 1e3:.0f}K" if a.family == "fast" else f"{main_params / 1e6:.2f}M",
            a.setting,
            f"{a.final_loss:.4f}",
            h.ratio(a.final_loss, d.final_loss, 3) if d else "-",
            h.change(a.final_loss, ref.final_loss) if ref and a is not ref else "-",
            h.change(a.final_loss, late.final_loss) if late else "-",
            sparkline(
                [y for _, y in a.curve], lows.get(a.family, math.nan), highs.get(a.family, math.nan)
            ),
            h.secs(a.wall_s),
        )

    sync = report.table(
        "GradientMail arms: rounds, waiting, lag, traffic (per learner unless said)",
        [
            "arm",
            "setting",
            "rounds committed / sync points",
            "contributors / round",
            "sync points skipped (all learners)",
            "time in step()",
            "step() waited (counter)",
            "commit lag: steps (median, max)",
            "commit lag: s",
            "up / learner",
            "down / learner",
            "samples in final model",
            "= reference bitwise",
        ],
        note=(
            "Sync points: due steps a learner reached (each should commit one round). "
            "Time in step(): the slowest learner's total time inside `session.step()` "
            "(measured around the calls); `step() waited`: `Counters.waited_s` (n/a where "
            "the library has no such counter). Commit lag: inner steps from a learner's "
            "snapshot to the step() call that applied its round (0 = exact DiLoCo). Samples "
            "in final model: the fewest samples any fragment's commits account for, against "
            "the samples trained. Bitwise: the aligned model "
            "against `reference`'s final parameters (max |difference| otherwise), and against "
            "`reference-late`'s where there is one."
        ),
    )
    for a in ordered:
        if not a.gradientmail or a.error:
            continue
        info = a.data
        skipped = info.get("skipped")
        bitwise = info.get("bitwise_reference")
        sync.add(
            a.arm + (" (tiny)" if a.family == "fast" else ""),
            a.setting,
            f"{info['rounds_committed']} / {info['sync_points']}"
            + (
                f" (counter {info['sync_points_counter']})"
                if info.get("sync_points_counter")
                else ""
            ),
            h.num(info.get("contributors_per_round"), "{:.2f}"),
            f"{skipped} of {info['skipped_total_points']}" if skipped is not None else "n/a",
            h.secs(info["step_s_max"]),
            h.secs(info["waited_s"]) if info.get("waited_s") is not None else "n/a",
            f"{h.num(info.get('lag_steps_median'), '{:.0f}')}, {h.num(info.get('lag_steps_max'))}",
            h.secs(info["lag_s_median"]) if info.get("lag_s_median") is not None else "n/a",
            h.size(info["bytes_up"]),
            h.size(info["bytes_down"]),
            (
                f"{info['samples_in_final']} / {info['samples_trained']}"
                if info.get("samples_in_final") is not None
                else "n/a"
            ),
            (
                "yes"
                if bitwise
                else f"no ({info['max_abs_diff_vs_reference']:.2g})"
                if bitwise is not None
                else "-"
            )
            + (
                ""
                if info.get("bitwise_reference_late") is None
                else "; = reference-late: yes"
                if info["bitwise_reference_late"]
                else f"; vs reference-late {info['max_abs_diff_vs_reference_late']:.2g}"
            ),
        )

    checkpoints = sorted({x for a in ordered for x, _ in a.curve if a.family == "main"})
    if checkpoints:
        curve = report.table(
            f"Loss curve: validation loss against samples seen (model of {main_params / 1e6:.2f}M)",
            ["arm", "setting", *[f"{x / 1000:.1f}K" for x in checkpoints]],
            note=(
                "GradientMail arms: the model of each fragment's newest commit at or before "
                "the checkpoint (samples committed)."
            ),
        )
        for a in ordered:
            if a.family != "main" or a.error:
                continue
            ys = dict(a.curve)
            curve.add(a.arm, a.setting, *[f"{ys[x]:.3f}" if x in ys else "" for x in checkpoints])

    compression_table(report, ordered, sizes)
    targets(report, bench, ordered, has_overlap, default_overlap, reference_of, late_of, ddp)
    report.data.update(
        {
            "sizes": sizes.to_json(),
            "corpus": corpus.describe(),
            "params": {"main": main_params, "fast": fast_params},
            "library": library,
            "overlap_setting": {"present": has_overlap, "default": repr(default_overlap)},
            "arms": rows,
            "seconds": round(seconds, 1),
        }
    )
    report.notes.append(
        f"gradientmail measured: {library.get('gradientmail_file')} at "
        f"{library.get('describe')}"
        + (" (library files modified)" if library.get("library_modified") else "")
        + f"; `overlap` setting: {'default ' + repr(default_overlap) if has_overlap else 'n/a'}"
    )
    for a in ordered:
        if a.data.get("failures"):
            report.notes.append(
                f"{a.label()}: {len(a.data['failures'])} failure events, "
                f"first: {a.data['failures'][0]}"
            )
        if a.data.get("curve_error"):
            report.notes.append(f"{a.label()}: no loss curve ({a.data['curve_error']})")
        if a.data.get("align_equals_newest") is False:
            report.notes.append(
                f"{a.label()}: gm.align loaded something other than the newest commits"
            )


def per_round(learners: Sequence[Mapping[str, Any]], rounds_committed: int) -> dict[str, Any]:
    """Bytes per learner per round: each learner's ``bytes_up`` and ``bytes_down`` (summed
    over kinds) over the rounds it applied (``Counters.applied``; the rounds committed where
    the counter is missing or zero), averaged over the learners."""
    ups, downs, applied, computed = [], [], [], []
    for r in learners:
        c = r["counters"]
        n = c.get("applied") or rounds_committed
        if not n:
            continue
        applied.append(n)
        computed.append(c.get("computed") or 0)
        ups.append(c.get("bytes_up_total", math.nan) / n)
        downs.append(c.get("bytes_down_total", math.nan) / n)
    up, down = h.mean(ups), h.mean(downs)
    return {
        "applied": h.mean(applied),
        "computed": h.mean(computed),
        "up": up,
        "down": down,
        "total": up + down,
    }


def contribution_bytes(settings: Mapping[str, Any] | None, numels: Sequence[int]) -> float:
    """One learner's contribution to one round, as encoded: every parameter tensor's
    ``Compression.encoded_bytes`` (dense: float32), over the fragments (exact for F = 1)."""
    if not settings or not numels:
        return math.nan
    c = settings.get("compression")
    if c:
        from gradientmail.algorithms.compression import compression_from_settings

        codec = compression_from_settings(c)
        total = sum(codec.encoded_bytes(n) for n in numels)
    else:
        total = 4 * sum(numels)
    return total / int(settings.get("fragments") or 1)


def compression_table(
    report: h.Report, ordered: Sequence[Arm], sizes: _lm.Sizes | None = None
) -> None:
    """Compressed arms against dense DiLoCo of the same H and F, same run: loss and bytes
    (the encoded contribution from the main model's parameter sizes, with ``sizes``)."""
    compressed = [a for a in ordered if a.compressed]
    if not compressed:
        return
    numels: list[int] = []
    if sizes is not None:
        model = _lm.build_model(sizes.model, sizes.context, sizes.seed)
        numels = [t.numel() for t in model.parameters()]

    def dense_of(arm: Arm) -> Arm | None:
        return next(
            (
                b
                for b in ordered
                if b.arm == "diloco"
                and b.overlap is None
                and b.mixing is None
                and (b.sync_every, b.fragments) == (arm.sync_every, arm.fragments)
                and not b.error
            ),
            None,
        )

    table = report.table(
        "Compressed contributions against dense DiLoCo (same H, F, learners, data, run)",
        [
            "arm",
            "setting",
            "algorithm",
            "final loss",
            "vs dense diloco",
            "rounds applied / learner",
            "up / learner / round",
            "down / learner / round",
            "up+down / learner / round",
            "dense / compressed: up",
            "dense / compressed: up+down",
            "contribution (encoded)",
            "dense / compressed: contribution",
        ],
        note=(
            "Bytes: each learner's `session.counters()` bytes_up and bytes_down summed over "
            "key kinds (payloads and records alike), over the rounds it applied "
            "(`Counters.applied`), averaged over the learners. `vs dense diloco`: "
            "final validation loss against the `diloco` arm of the same H and F in this run "
            "(ratio, and the difference in %). SparseLoCo learners compute commits from the "
            "rounds' compressed contributions instead of downloading parameters (their "
            "`computed` counter, in brackets after the rounds). Contribution: what one "
            "learner's contribution to a round encodes to (`encoded_bytes` of every parameter "
            "tensor, float32 when dense; over F): the closer's commit upload (parameters, and "
            "DiLoCo's momentum) and the commit downloads are not compressed, and dominate "
            "the totals of a small model."
        ),
    )
    rows: list[dict[str, Any]] = []
    bases = []
    for a in compressed:
        base = dense_of(a)
        if base is not None and base not in bases:
            bases.append(base)
    for a in [*bases, *compressed]:
        base = a if not a.compressed else dense_of(a)
        if a.error:
            table.add(a.arm, a.setting, "", f"ERROR: {a.error}", *[""] * 9)
            rows.append({"key": a.key, "arm": a.arm, "error": a.error})
            continue
        learners = a.data.get("learners") or []
        settings = learners[0].get("algorithm") if learners else a.algorithm
        mine = per_round(learners, a.data.get("rounds_committed", 0))
        ref = (
            per_round(base.data.get("learners") or [], base.data["rounds_committed"])
            if base
            else None
        )
        base_learners = (base.data.get("learners") or []) if base else []
        sent = contribution_bytes(settings, numels)
        sent_dense = (
            contribution_bytes(base_learners[0].get("algorithm"), numels)
            if base_learners
            else math.nan
        )
        applied = h.num(mine["applied"], "{:.1f}") + (
            f" ({h.num(mine['computed'], '{:.1f}')} computed)" if mine["computed"] else ""
        )
        table.add(
            a.arm,
            a.setting,
            describe_algorithm(settings),
            f"{a.final_loss:.4f}",
            (
                f"{h.ratio(a.final_loss, base.final_loss, 4)} "
                f"({h.change(a.final_loss, base.final_loss)})"
                if base
                else "no dense diloco arm"
            ),
            applied,
            h.size(mine["up"]),
            h.size(mine["down"]),
            h.size(mine["total"]),
            h.ratio(ref["up"], mine["up"], 1) if ref else "-",
            h.ratio(ref["total"], mine["total"], 1) if ref else "-",
            h.size(sent),
            h.ratio(sent_dense, sent, 1),
        )
        rows.append(
            {
                "key": a.key,
                "arm": a.arm,
                "algorithm": settings,
                "final_loss": a.final_loss,
                "dense": base.key if base else None,
                "vs_dense": a.final_loss / base.final_loss - 1 if base else None,
                "bytes_per_round": mine,
                "dense_over_compressed_up": _div(ref["up"], mine["up"]) if ref else None,
                "dense_over_compressed_total": (_div(ref["total"], mine["total"]) if ref else None),
                "contribution_bytes": sent,
                "dense_over_compressed_contribution": _div(sent_dense, sent),
            }
        )
    report.data["compression"] = rows


def _div(value: float, by: float) -> float | None:
    if math.isnan(value) or math.isnan(by) or by == 0:
        return None
    return value / by


def _file_twin(arms: Mapping[str, Arm], arm: Arm) -> str | None:
    """The file-mailbox diloco arm of the same setting as ``arm``."""
    for other in arms.values():
        if (
            other.arm == "diloco"
            and other.overlap is None
            and (other.sync_every, other.fragments) == (arm.sync_every, arm.fragments)
        ):
            return other.key
    return None


def targets(
    report: h.Report,
    bench: Bench,
    ordered: Sequence[Arm],
    has_overlap: bool,
    default_overlap: Any,
    reference_of: Callable[[Arm], Arm | None],
    late_of: Callable[[Arm], Arm | None],
    ddp: Mapping[str, Arm | None],
) -> None:
    gm_arms = [a for a in ordered if a.gradientmail and not a.error]
    for a in ordered:
        if a.gradientmail and a.error:
            report.target(f"{a.label()} ran", "failed", "runs", False, a.error)
    # Compressed arms are not the reference's algorithm: their table compares them with
    # dense DiLoCo; only the rounds target below applies to them.
    dense = [a for a in gm_arms if not a.compressed]
    exact = [a for a in dense if effective_overlap(a, has_overlap, default_overlap) == 0]
    free = [a for a in dense if a not in exact]
    # Without overlap: every diloco arm equals reference. Before the setting exists, every
    # arm is measured against it (the issue: "until then, measure what exists").
    for a in exact if has_overlap else dense:
        ref = reference_of(a)
        if ref is None:
            continue
        gap = a.final_loss / ref.final_loss - 1
        bit = a.data.get("bitwise_reference")
        why = ""
        if not has_overlap:
            why = (
                "this library has no `overlap` setting: commits are applied whenever they "
                f"arrive (median lag {h.num(a.data.get('lag_steps_median'))} steps) and "
                f"{a.data.get('skipped') or 0} sync points were skipped"
            )
        elif abs(gap) > 0.005:
            why = "see rounds, skips and lag in the table above"
        report.target(
            f"{a.label()} = reference (no overlap)",
            f"{100 * gap:+.2f}%" + (", bitwise" if bit else ""),
            "within ±0.5%",
            abs(gap) <= 0.005,
            why,
        )
    for a in free:
        late = late_of(a)
        ref = reference_of(a)
        if late is None:
            lag = a.data.get("lag_steps_median")
            report.target(
                f"{a.label()} = reference-late",
                "not run",
                "within ±0.5%",
                None,
                f"median lag {h.num(lag)} steps: no reference-late to compare with",
            )
            continue
        gap = a.final_loss / late.final_loss - 1
        price = (
            f"; price of overlap vs reference {h.change(late.final_loss, ref.final_loss)}"
            if ref
            else ""
        )
        if a.arm == "diloco-s3":
            price += (
                "; N from the file arm (this arm's median lag "
                f"{h.num(a.data.get('lag_steps_median'))} steps)"
            )
        report.target(
            f"{a.label()} = reference-late (N={late.late})",
            f"{100 * gap:+.2f}%",
            "within ±0.5%",
            abs(gap) <= 0.005,
            f"skipped {a.data.get('skipped') or 0} sync points{price}",
        )
    # solo-average at least 5% worse than reference (the main one).
    solo = next((a for a in ordered if a.arm == "solo-average" and not a.error), None)
    main_ref = next(
        (
            a
            for a in ordered
            if a.arm == "reference" and a.family == "main" and a.fragments == 1 and not a.error
        ),
        None,
    )
    if solo and main_ref:
        gap = solo.final_loss / main_ref.final_loss - 1
        report.target(
            f"solo-average worse than reference {main_ref.setting}",
            f"{100 * gap:+.2f}%",
            ">= +5%",
            gap >= 0.05,
            ""
            if gap >= 0.05
            else "the shards are too alike or the run too short to tell syncing from not",
        )
    # Rounds committed against sync points reached.
    for a in gm_arms:
        d = a.data
        points = d.get("sync_points_counter") or d["sync_points"]
        share = d["rounds_committed"] / points if points else math.nan
        report.target(
            f"{a.label()}: rounds committed / sync points",
            f"{d['rounds_committed']} / {points} ({100 * share:.0f}%)",
            ">= 95%",
            share >= 0.95,
            "" if share >= 0.95 else f"{d.get('skipped') or 0} sync points skipped across learners",
        )
    # Streaming: fragments 4 within 1% of fragments 1.
    for a in gm_arms:
        if a.arm != "diloco" or a.fragments == 1 or a.overlap is not None:
            continue
        one = next(
            (
                b
                for b in gm_arms
                if b.arm == "diloco"
                and b.fragments == 1
                and b.sync_every == a.sync_every
                and b.overlap is None
            ),
            None,
        )
        if one is None:
            continue
        gap = a.final_loss / one.final_loss - 1
        report.target(
            f"diloco H={a.sync_every}: fragments {a.fragments} vs fragments 1",
            f"{100 * gap:+.2f}%",
            "within ±1%",
            abs(gap) <= 0.01,
            "" if abs(gap) <= 0.01 else _streaming_why(a),
        )
    # The algorithm's own gap at this scale (reported, not a target).
    for a in ordered:
        base = ddp.get(a.family)
        if a.arm == "reference" and base and not a.error:
            report.notes.append(
                f"reference {a.setting}{' (tiny)' if a.family == 'fast' else ''} against ddp: "
                f"{h.change(a.final_loss, base.final_loss)} (the algorithm's own gap at this scale)"
            )


def _streaming_why(a: Arm) -> str:
    d = a.data
    if d.get("samples_in_final") is not None and d["samples_in_final"] < d["samples_trained"]:
        lost = 1 - d["samples_in_final"] / d["samples_trained"]
        return (
            f"the final model misses up to {100 * lost:.0f}% of the samples trained "
            "(tails not contributed)"
        )
    return "see the loss curve"


# -- the plot --------------------------------------------------------------------------------


def plot_path(ctx: h.Context) -> Path:
    given = ctx.options.get("json_path")
    if given:
        path = Path(given)
        stem = path.stem if path.stem.startswith("quality") else f"{path.stem}-quality"
        return path.with_name(stem + ".png")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return h.ROOT / "bench" / "results" / f"quality-{stamp}.png"


def write_plot(bench: Bench, path: Path, main_params: int, fast_params: int) -> str:
    """The loss curves as a PNG; without matplotlib, say why instead."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        h.progress(f"no plot: {exc} (pip install matplotlib)")
        return f"not written: {exc}"
    arms = [a for a in bench.arms.values() if a.curve and not a.error]
    # One panel per model and H; ddp and solo-average (no H) appear in every panel of their
    # model. Colour: the arm; line: the fragments.
    panels = sorted(
        {(a.family, a.sync_every) for a in arms if a.sync_every is not None},
        key=lambda p: (p[0] == "fast", p[1] or 0),
    )
    if not panels:
        return "not written: no curves"
    colours = {
        "ddp": "black",
        "solo-average": "tab:gray",
        "reference": "tab:blue",
        "diloco": "tab:orange",
        "diloco-fast": "tab:orange",
        "diloco-s3": "tab:purple",
        "reference-late": "tab:green",
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for ax, (family, h_every) in zip(axes[0], panels, strict=True):
        shown = [
            a
            for a in arms
            if a.family == family and (a.sync_every is None or a.sync_every == h_every)
        ]
        tops = []
        for a in sorted(
            shown, key=lambda a: (list(colours).index(a.arm) if a.arm in colours else 9, a.key)
        ):
            xs = [x / 1000 for x, _ in a.curve]
            ys = [y for _, y in a.curve]
            tops += ys[1:] or ys
            exact = a.overlap == 0
            ax.plot(
                xs,
                ys,
                color=(
                    "tab:red"
                    if exact
                    else None  # compressed arms: the colour cycle, dotted
                    if a.compressed
                    else colours.get(a.arm, "tab:brown")
                ),
                linestyle=":" if a.compressed else "--" if (a.fragments or 1) > 1 else "-",
                marker="o",
                markersize=3,
                label=a.label(),
                alpha=0.85,
            )
        if tops:  # the first checkpoint (an H=100 run's initial model) would dwarf the rest
            low, high = min(tops), max(tops)
            ax.set_ylim(low - 0.05 * (high - low) - 0.01, high + 0.15 * (high - low) + 0.01)
        size = f"{main_params / 1e6:.2f}M" if family == "main" else f"tiny {fast_params / 1e3:.0f}K"
        ax.set_title(f"model {size}, H={h_every} (dashed: F>1)")
        ax.set_xlabel("samples seen (thousands)")
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    h.progress(f"plot: {path}")
    return str(path)


def main(argv: Sequence[str] | None = None, prog: str = "python -m bench.quality") -> int:
    """``python -m bench.quality``: this benchmark alone, with its own options."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes")
    size.add_argument("--large", action="store_true", help="the issue's full ranges (slow)")
    size.add_argument("--tiny", action="store_true", help="Moshpit arms: 4 learners, M=2 d=2")
    parser.add_argument(
        "--arms",
        default="",
        help="comma-separated arm names or keys to run (default: all but the compressed "
        "ones), e.g. diloco-H25-F1,sparseloco-2%%; `compression` names every compressed arm: "
        + ", ".join(COMPRESSION_ARMS).replace("%", "%%")
        + "; `moshpit` the Moshpit comparison",
    )
    parser.add_argument(
        "--compression-arms",
        action="store_true",
        help="add every compressed arm to the selection (they run against the diloco arm "
        "of the smallest H and F)",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no compressed arm that would end past this (the last arm's time as the "
        "estimate); the report names those skipped",
    )
    parser.add_argument("--sparseloco-outer-lr", type=float, default=None)
    parser.add_argument("--sparseloco-error-decay", type=float, default=None)
    parser.add_argument("--no-s3", action="store_true", help="skip the SeaweedFS arm")
    mosh = parser.add_argument_group("the Moshpit arms (--arms moshpit)")
    mosh.add_argument("--learners", type=int, default=None, help="N (default 8; --tiny 4)")
    mosh.add_argument("--grids", default="", help="MxD,... (default 2x3,4x2; --tiny 2x2)")
    mosh.add_argument("--steps", type=int, default=None, help="local steps per learner")
    mosh.add_argument("--no-inprocess", action="store_true", help="skip ddp and solo-average")
    mosh.add_argument("--round-timeout", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON record")
    parser.add_argument("--md", type=Path, default=None, help="also write the report (Markdown)")
    args = parser.parse_args(argv)
    options: dict[str, Any] = {"s3": not args.no_s3}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if arms:
        options["arms"] = arms
    if args.compression_arms:
        options["compression_arms"] = True
    if args.max_minutes is not None:
        options["max_seconds"] = 60 * args.max_minutes
    tuning = {
        key: value
        for key, value in (
            ("outer_lr", args.sparseloco_outer_lr),
            ("error_decay", args.sparseloco_error_decay),
        )
        if value is not None
    }
    if tuning:
        options["sparseloco"] = tuning
    moshpit: dict[str, Any] = {"inprocess": not args.no_inprocess}
    if args.tiny:
        moshpit |= {"tiny": True, "learners": 4, "grids": [[2, 2]], "poll_interval": 0.1}
    for key in ("learners", "steps", "round_timeout"):
        if getattr(args, key) is not None:
            moshpit[key] = getattr(args, key)
    if args.grids:
        moshpit["grids"] = [[int(x) for x in g.lower().split("x")] for g in args.grids.split(",")]
    options["moshpit"] = moshpit
    from bench.__main__ import run_suite

    return run_suite(
        [NAME],
        quick=args.quick,
        large=args.large,
        options={
            NAME: options,
            "json_path": str(args.json) if args.json is not None else None,
        },
        json_path=args.json,
        md_path=args.md,
    )


if __name__ == "__main__":
    sys.exit(main())
