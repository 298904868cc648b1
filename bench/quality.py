"""Benchmark 8 — training quality on real text: does a GradientMail run learn the model the
algorithm promises? Against data-parallel training and DiLoCo computed in one process with
zero latency, in the same run.

A byte-level LM (``_lm.py``) trains on the stdlib's ``.py`` sources, M = 4 non-IID shards,
every arm the same samples: ``ddp`` (batch M·B), ``reference`` (M copies in one process,
``gm.DiLoCo.combine`` itself), ``diloco`` (M learner processes through ``gm.Session`` on a
file mailbox, evaluated with ``gm.align`` in another process) for each H and F, the default
``overlap`` and the other side of it, ``diloco-fast`` (a tiny model), ``diloco-s3`` (the best
setting on SeaweedFS), ``reference-late`` (outer steps applied N steps late),
``solo-average``, ``diloco-bfloat16`` (a bfloat16 model, float32 outer state) against
``reference-bfloat16``; on request ``diloco-ddp`` (learners of 2 DDP ranks, gloo) against
``reference-ddp``, the compressed arms (:data:`COMPRESSION_ARMS`) and the Moshpit arms
(``quality_moshpit.py``). bench/README.md describes every arm and target; the arms
computed in one process are ``_lm.run_inprocess``, the processes ``_quality_worker.py``.

    .venv/bin/python -m bench quality [--quick | --large]
    .venv/bin/python -m bench.quality --quick --arms diloco-H25-F1,compression
    .venv/bin/python -m bench.quality --quick --arms diloco-ddp,reference-ddp
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench import _lm
from bench import _quality_report as qr
from bench._procs import Job, JobFailed, child_env, run_pool, run_together, seaweedfs_specs
from gradientmail.demo import lm
from gradientmail.launch.ranks import free_port

NAME = "quality"
M = _lm.LEARNERS
TITLE = "8. Training quality on real text: GradientMail against DiLoCo in one process and DDP"
REFERENCE = (
    "`ddp` (synchronous data-parallel, batch M·B) and `reference` (the same DiLoCo in one "
    "process with zero latency, `gm.DiLoCo.combine` itself), same samples, same run"
)


PRESETS: dict[str, dict[str, Any]] = {  # model: (d_model, layers, heads); steps: T/M
    "quick": {"model": (64, 2, 4), "batch": 4, "steps": 300, "checkpoints": 6}
    | {"eval_windows": 256, "sync_every": (25,), "fragments": (1, 4)},
    "large": {"model": (192, 4, 6), "batch": 8, "steps": 2400, "lr": 1e-3, "checkpoints": 10}
    | {"eval_windows": 1024, "threads": max(1, (os.cpu_count() or 2) // M)},
    "default": {"model": (128, 2, 4), "batch": 4, "steps": 800},
}


def sizes_for(ctx: h.Context) -> _lm.Sizes:
    """The preset's sizes (the tiny model: d_model 32, 1 layer, as many steps);
    ``ctx.options["quality"]["sizes"]`` (tests) overrides them."""
    given = ctx.options.get(NAME, {}).get("sizes")
    if given is not None:
        return given if isinstance(given, _lm.Sizes) else _lm.Sizes.from_json(given)
    values = dict(PRESETS[ctx.pick("default", "quick", "large")])
    values["model"] = lm.ModelSize(*values["model"])
    return _lm.Sizes(fast_model=lm.ModelSize(32, 1, 2), fast_steps=values["steps"], **values)


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

VARIANT_ARMS: dict[str, dict[str, Any]] = {
    "diloco-bfloat16": {"dtype": "bfloat16"},  # in the default run
    "diloco-ddp": {"ranks": 2},  # on request: 2 processes per learner
}
"""Exact DiLoCo (``overlap=0``) of the smallest H and F with another model dtype or
learners of several ranks, each against the in-process reference of the same dtype and
layout (``Arm.reference_key``), bitwise. ``reference-bfloat16`` keeps the outer state in
float32 as a run does; ``reference-ddp`` takes each learner's step as two half-batch
gradients averaged as DDP averages them (``_lm.ranks_train_step``)."""
ON_REQUEST = frozenset({"diloco-ddp"})


# -- arms ------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One row of the report."""

    key: str
    arm: str  # ddp, reference, diloco, ...
    family: str  # main or fast
    sync_every: int | None = None
    fragments: int | None = None
    overlap: int | None = None  # None: the library's default
    late: int | None = None
    mixing: float | None = None  # Streaming DiLoCo's blend of a late commit (None: rebase)
    backend: str = ""
    algorithm: dict[str, Any] | None = None  # compressed and Moshpit arms: the learners'
    learners: int | None = None  # learner processes or in-process shards (None: M)
    described: str | None = None  # the setting column, where given (the Moshpit arms)
    dtype: str = "float32"  # the model's parameters (the outer state is float32 always)
    ranks: int = 1  # processes per learner (DDP, gloo)
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
        named = (
            ("H", self.sync_every),
            ("F", self.fragments),
            ("overlap", self.overlap),
            ("mixing", self.mixing),
            ("N", self.late),
        )
        parts = [f"{k}={v}" for k, v in named if v is not None]
        parts += [self.dtype] * (self.dtype != "float32")
        parts += [f"{self.ranks} ranks"] * (self.ranks > 1)
        tuned = sorted(((self.algorithm or {}).get("settings") or {}).items())
        parts += [f"{k}={v:g}" for k, v in tuned] + [self.backend] * bool(self.backend)
        return " ".join(parts) or "-"

    @property
    def compressed(self) -> bool:
        """A compressed-contributions arm (``COMPRESSION_ARMS``)."""
        return self.algorithm is not None

    @property
    def gradientmail(self) -> bool:
        """Learner processes through ``gm.Session`` (diloco*, compressed arms)."""
        return self.arm.startswith("diloco") or self.compressed

    @property
    def variant(self) -> str:
        """What sets the arm's model or learners apart, as its keys spell it: ``-fast``
        (the tiny model), ``-bfloat16`` (another dtype), ``-ddp`` (several ranks)."""
        fast = "-fast" if self.family == "fast" else ""
        dtype = "" if self.dtype == "float32" else f"-{self.dtype}"
        return fast + dtype + ("-ddp" if self.ranks > 1 else "")

    @property
    def reference_key(self) -> str:
        """The key of the in-process reference of the same H, F, model and dtype, and layout:
        the one home of which arm a GradientMail arm is compared with."""
        return f"reference{self.variant}-H{self.sync_every}-F{self.fragments}"

    def label(self) -> str:
        model = " (tiny)" if self.family == "fast" else ""
        return f"{self.arm}{model}" + ("" if self.setting == "-" else f" {self.setting}")


class Bench:
    """The arms of one run: their jobs in a scratch directory (removed on exit unless
    ``keep_workdir``), the data file every process reads, the arms' rows and parameters."""

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
        self.timeout_scale = float(ctx.options.get(NAME, {}).get("timeout_scale", 1.0))

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *_: object) -> None:
        if not self.ctx.options.get(NAME, {}).get("keep_workdir"):
            shutil.rmtree(self.dir, ignore_errors=True)

    def save_data(self, shards: Sequence[Any], val: Any) -> None:
        import torch

        torch.save({"shards": list(shards), "val": val}, self.data)

    # Timeouts: generous multiples of the expected time on a loaded 2-core machine; more
    # learner processes than M share the cores.
    def _train_timeout(self, family: str, learners: int | None = None) -> float:
        _, steps = self.sizes.family(family)
        share = 1.0 if learners is None else max(1.0, learners / self.parallel)
        return self.timeout_scale * (300 + 1.5 * steps * share)

    def inprocess(
        self,
        key: str,
        arm: str,
        family: str,
        sync_every: int | None = None,
        fragments: int | None = None,
        late: int | None = None,
        learners: int | None = None,
        *,
        like: Arm | None = None,
    ) -> tuple[Arm, Job]:
        """An arm computed in one process (over every shard of the data file), and its job;
        its row takes its place in the report's order now. ``like``: the model dtype and
        ranks of that GradientMail arm (its reference: ``arm`` is ``reference-...``)."""
        save = self.params[key] = self.dir / f"{key}.params.pt"
        row = self.arms[key] = Arm(key, arm, family, sync_every, fragments, late=late)
        row.learners = learners
        if like is not None:
            row.dtype, row.ranks = like.dtype, like.ranks
        spec = {
            "mode": "inprocess",
            "sizes": self.sizes.to_json(),
            "data": str(self.data),
            "arm": "reference" if like is not None else arm,
            "dtype": row.dtype,
            "ranks": row.ranks,
            "family": family,
            "sync_every": sync_every or 25,
            "fragments": fragments or 1,
            "late": late or 0,
            "tail": True,
            "save": str(save),
        }
        return row, Job(key, spec, self._train_timeout(family) * ((learners or M) + 1), self.dir)

    def record_inprocess(self, job: Job, arm: Arm) -> None:
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
        keys = ("train_loss", "sync_points", "rounds", "extra", "gradientmail_file")
        arm.data = {k: value[k] for k in keys}
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

    def run_diloco(
        self,
        arm: Arm,
        box: Callable[[], dict[str, Any]],
        learner: Callable[[int], dict[str, Any]] = lambda i: {},
        evaluation: Mapping[str, Any] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, Any]] | None:
        """``arm.learners`` (M) learner processes on the mailbox ``box()`` describes, all at
        once; then ``gm.align`` in another process, as a user would. ``learner(i)`` and
        ``evaluation``: more of their jobs' settings. Their results; None when one failed."""
        self.arms[arm.key] = arm
        n, ranks = arm.learners or M, arm.ranks
        processes = n * ranks if ranks > 1 else arm.learners
        timeout = self._train_timeout(arm.family, processes) * 2
        save = self.dir / f"{arm.key}.params.pt"
        label = f"{arm.label()} on {arm.backend}"
        base = {
            "sizes": self.sizes.to_json(),
            "data": str(self.data),
            "family": arm.family,
            "fragments": arm.fragments,
            "mailbox": box(),
            "learners": n,
            "dtype": arm.dtype,
        }
        mine: dict[str, Any] = {"sync_every": arm.sync_every, "overlap": arm.overlap}
        mine |= {
            "mixing": arm.mixing,
            "algorithm": arm.algorithm,
            "timeout": timeout - 60,
            "ranks": ranks,
        }
        # A learner of several ranks: its processes meet on a loopback port of its own.
        ports = [free_port() if ranks > 1 else 0 for _ in range(n)]
        jobs = [
            Job(
                f"{arm.key}.learner-{i}" + (f".rank-{r}" if ranks > 1 else ""),
                {"mode": "learner", **base, **mine, "learner": i, **learner(i)}
                | {"rank": r, "port": ports[i]},
                timeout,
                self.dir,
            )
            for i in range(n)
            for r in range(ranks)
        ]
        spec = {"mode": "evaluate", **base, "save": str(save), **(evaluation or {})}
        ev_job = Job(f"{arm.key}.evaluate", spec, self.timeout_scale * 600, self.dir)
        h.progress(f"{label}: {n} learners of {ranks} process(es)")
        t0 = time.monotonic()
        try:
            run_together(jobs, self.env, label)
            processes_s = time.monotonic() - t0
            every = [job.value() for job in jobs]
            results = [r for r in every if r.get("rank", 0) == 0]  # a learner's rank 0 speaks
            run_together([ev_job], self.env, f"{label} evaluation")
            ev = ev_job.value()
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
        if ranks > 1:
            arm.data |= rank_traffic(every)
        d = arm.data
        h.progress(
            f"{arm.label()}: validation loss {arm.final_loss:.4f}, rounds "
            f"{d['rounds_committed']}/{d['sync_points']}, skipped {d['skipped']}, lag "
            f"{d['lag_steps_median']} steps ({arm.wall_s:.0f} s)"
        )
        return results, ev

    def file_box(self) -> dict[str, Any]:
        return {"kind": "file", "root": str(self.dir / f"mailbox-{uuid.uuid4().hex[:6]}")}


def summarize(
    learners: Sequence[Mapping[str, Any]], ev: Mapping[str, Any], processes_s: float
) -> dict[str, Any]:
    """A diloco arm's numbers from its learners' and its evaluation's results."""

    def counter(name: str, kind: Any) -> list[Any]:
        return [v for r in learners if isinstance(v := r["counters"].get(name), kind)]

    sync_points = [r["sync_points"] for r in learners]
    counted = counter("sync_points", int)
    rounds = ev.get("rounds", [])
    lags = [x for r in learners for x in r["lag_steps"]]
    lag_s = [x for r in learners for x in r["lag_s"] if not math.isnan(x)]
    waited, waits = counter("waited_s", int | float), counter("waits", int)
    skipped = counter("skipped_syncs", int)
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
        "samples_trained": sum(r["samples"] for r in learners),
        # Every round of a fragment accounts for all learners' samples since its last one.
        "samples_in_final": min(committed) if committed else None,
        "samples_committed": committed,
        "failures": [f for r in learners for f in r["failures"]],
        "gradientmail_file": learners[0].get("gradientmail_file"),
        "align_equals_newest": ev.get("align_equals_newest"),
        "curve_error": ev.get("curve_error"),
    }


def rank_traffic(every: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A multi-rank arm's numbers per rank: each process's mailbox bytes and requests
    (``session.counters()``: rank 0 alone talks to the mailbox, the others receive what
    it applied by broadcast and count nothing), the rounds its learner applied (rank 0's
    ``applied``), and whether the ranks of every learner ended with the same parameters."""
    applied = {r["learner"]: r["counters"].get("applied") for r in every if r["rank"] == 0}
    digests: dict[str, set[str]] = {}
    rows = []
    for r in every:
        c = r["counters"]
        digests.setdefault(r["learner"], set()).add(r.get("params_digest") or "")
        rows.append(
            {
                "learner": r["learner"],
                "rank": r["rank"],
                "bytes_up": c.get("bytes_up_total", 0),
                "bytes_down": c.get("bytes_down_total", 0),
                "requests": c.get("requests_total", 0),
                "rounds_applied": applied.get(r["learner"]) or 0,
            }
        )
    return {
        "ranks": rows,
        "ranks_identical": all(len(d) == 1 and "" not in d for d in digests.values()),
    }


def library_commit() -> dict[str, Any]:
    """The git commit of the library this bench/ sits beside, and whether it is modified."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=h.ROOT, capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            return f"unknown: {exc}"

    changes = git("status", "--porcelain", "--", "gradientmail")
    return {
        "commit": git("rev-parse", "HEAD"),
        "describe": git("describe", "--always", "--dirty"),
        "library_changes": changes,
        "library_modified": bool(changes),
    }


# -- the run ---------------------------------------------------------------------------------


def run(ctx: h.Context) -> h.Report:
    from bench import quality_moshpit

    chosen = set(ctx.options.get(NAME, {}).get("arms") or ())
    moshpit = quality_moshpit.wanted(chosen)
    if moshpit and chosen <= quality_moshpit.ARM_NAMES:  # the Moshpit comparison alone
        report = h.Report(NAME, quality_moshpit.TITLE, quality_moshpit.REFERENCE)
    else:
        report = h.Report(NAME, TITLE, REFERENCE)
        with Bench(ctx, sizes_for(ctx)) as bench:
            _run(ctx, bench, report)
    if moshpit:  # after the others: a run of its own, N learners on N shards
        quality_moshpit.run_arms(ctx, report)
    return report


def _run(ctx: h.Context, bench: Bench, report: h.Report) -> None:
    import gradientmail as gm

    options = ctx.options.get(NAME, {})
    sizes = bench.sizes
    started = time.monotonic()
    h.progress("reading the standard library's sources")
    corpus = sizes.corpus()
    bench.save_data(corpus.shards, corpus.val)
    default_overlap = inspect.signature(gm.Session).parameters["overlap"].default
    library = library_commit() | {"gradientmail_file": gm.__file__}
    main_params = lm.param_count(sizes.model, sizes.context)
    fast_params = lm.param_count(sizes.fast_model, sizes.context)
    h.progress(
        f"corpus: {corpus.files} files, {corpus.train_bytes / 1e6:.1f} MB train, "
        f"{corpus.val_bytes / 1e6:.2f} MB held out; model {main_params / 1e6:.2f}M params, "
        f"tiny {fast_params / 1e3:.0f}K; gradientmail {gm.__file__} "
        f"({library.get('describe')}); overlap default {default_overlap!r}"
    )
    hs, fragments = sorted(sizes.sync_every), sorted(sizes.fragments)
    h_main = hs[0]
    arms_filter: set[str] | None = set(options["arms"]) if options.get("arms") else None

    def wanted(*names: str) -> bool:
        return arms_filter is None or any(name in arms_filter for name in names)

    # 1. The diloco arms, each alone on the machine (M learner processes); then the other
    # side of the library's default overlap: exact DiLoCo (overlap=0) where the default
    # overlaps, else commits applied up to H/5 steps late (the price of overlap, against
    # reference-late); and that overlap with Streaming DiLoCo's blend (param <- a*param +
    # (1-a)*commit) instead of keeping all local progress.
    diloco_arms = [Arm(f"diloco-H{x}-F{f}", "diloco", "main", x, f) for x in hs for f in fragments]
    other = 0 if default_overlap != 0 else max(1, h_main // 5)
    late = max(1, h_main // 5)
    diloco_arms += [
        Arm(f"diloco-H{h_main}-F1-o{other}", "diloco", "main", h_main, 1, other),
        Arm(f"diloco-H{h_main}-F1-o{late}-a0.5", "diloco", "main", h_main, 1, late, mixing=0.5),
    ]
    for arm in diloco_arms:
        arm.backend = "file"
    if wanted("diloco-fast"):
        diloco_arms.append(Arm("diloco-fast", "diloco-fast", "fast", h_main, 1, backend="file"))
    for arm in diloco_arms:
        if wanted(arm.arm, arm.key):
            bench.run_diloco(arm, bench.file_box)
    # Another model dtype, learners of several ranks: exact DiLoCo against their references.
    variants = variant_arms(arms_filter, h_main, fragments[0])
    for arm in variants:
        bench.run_diloco(arm, bench.file_box)
    # On request: compressed contributions, each like the diloco arm of the smallest H and F,
    # the most telling first; with a time budget, those that would overrun it are skipped.
    budget = options.get("max_seconds")
    last = 0.0
    skipped: list[str] = []
    for arm in compression_arms(options, arms_filter, h_main, fragments[0]):
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
    for family, suffix in (("main", ""), ("fast", "-fast")):
        if wanted("ddp"):
            specs.append(bench.inprocess(f"ddp{suffix}", "ddp", family))
        configs = [(h_main, 1)]
        if family == "main":
            configs += [(x, f) for x in hs for f in fragments if (x, f) != configs[0]]
        if wanted("reference"):
            for x, f in configs:
                specs.append(
                    bench.inprocess(f"reference{suffix}-H{x}-F{f}", "reference", family, x, f)
                )
        if family == "main" and wanted("solo-average"):
            specs.append(bench.inprocess("solo-average", "solo-average", family))
    for arm in variants:  # each against the reference of its own dtype and layout
        name = arm.reference_key.split("-H")[0]
        ran = arm.key in bench.arms and not bench.arms[arm.key].error
        if ran and wanted("reference", name, arm.reference_key):
            specs.append(
                bench.inprocess(
                    arm.reference_key, name, "main", arm.sync_every, arm.fragments, like=arm
                )
            )
    for arm in diloco_arms:
        done = bench.arms.get(arm.key)
        if done is None or done.error or not wanted("reference-late"):
            continue
        # exact DiLoCo, or a blend: reference is its comparison
        if qr.effective_overlap(arm, default_overlap) == 0 or arm.mixing is not None:
            continue
        lag = done.data.get("lag_steps_median")
        if lag is None:
            continue
        assert arm.sync_every is not None
        n = min(round(lag), arm.sync_every - 1)
        if n <= 0:
            done.data["late_note"] = "lag 0 steps: reference-late is reference"
            continue
        key = f"reference-late-{arm.key}"
        specs.append(
            bench.inprocess(key, "reference-late", arm.family, arm.sync_every, arm.fragments, n)
        )
    bench.run_inprocess(specs)

    # 3. The best file setting again on SeaweedFS.
    if wanted("diloco-s3") and options.get("s3", True):
        candidates = [
            a
            for a in bench.arms.values()
            if a.arm == "diloco" and not a.error and a.overlap is None and a.mixing is None
        ]
        if candidates:
            best = min(candidates, key=lambda a: a.final_loss)
            s3 = Arm("diloco-s3", "diloco-s3", "main", best.sync_every, best.fragments)
            s3.backend = "seaweedfs"
            try:
                h.progress("starting SeaweedFS")
                with seaweedfs_specs(bench.dir, NAME) as box:
                    bench.run_diloco(s3, box)
                    h.progress("stopping SeaweedFS")
            except Exception as exc:
                s3.error = f"{type(exc).__name__}: {exc}"
                bench.arms[s3.key] = s3
                h.progress(f"diloco-s3: FAILED {s3.error}")

    compare_params(bench)
    qr.build(
        report,
        bench,
        corpus,
        library,
        default_overlap,
        (main_params, fast_params),
        time.monotonic() - started,
    )
    report.data["png"] = qr.write_plot(bench, qr.plot_path(ctx), main_params, fast_params)


def variant_arms(arms_filter: set[str] | None, h_every: int, fragments: int) -> list[Arm]:
    """The :data:`VARIANT_ARMS` asked for: those named (by arm or key), else the ones not
    :data:`ON_REQUEST` when no arm is named; exact DiLoCo (``overlap=0``) of H and F."""
    arms = []
    for name, values in VARIANT_ARMS.items():
        key = f"{name}-H{h_every}-F{fragments}"
        named = arms_filter is not None and bool({name, key} & arms_filter)
        if named or (arms_filter is None and name not in ON_REQUEST):
            arm = Arm(key, name, "main", h_every, fragments, 0, backend="file", **values)
            arms.append(arm)
    return arms


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
        key = f"{name}-H{h_every}-F{fragments}"
        arms.append(Arm(key, name, "main", h_every, fragments, backend="file", algorithm=algorithm))
    return arms


def compare_params(bench: Bench) -> None:
    """Max |aligned - reference| per GradientMail arm: is it the algorithm, bit for bit?
    And against ``reference-late``'s where there is one; a multi-rank arm also against the
    one-rank reference of its dtype (``reference_one_rank``: how far DDP's averaged
    half-batch gradients take the model from whole-batch gradients), where it ran."""
    import torch

    def load(key: str) -> dict[str, torch.Tensor] | None:
        path = bench.params.get(key)
        return torch.load(path, weights_only=True) if path and path.exists() else None

    for arm in bench.arms.values():
        if not arm.arm.startswith("diloco") or arm.compressed or arm.error:
            continue
        x = load(arm.key)
        pairs = [("reference", arm.reference_key), ("reference_late", f"reference-late-{arm.key}")]
        if arm.ranks > 1:
            pairs.append(("reference_one_rank", replace(arm, ranks=1).reference_key))
        for name, key in pairs:
            y = load(key)
            if x is None or y is None or set(x) != set(y):
                if name == "reference":
                    break  # no reference: no comparison with reference-late either
                continue
            diff = max(float((x[n].float() - y[n].float()).abs().max()) for n in x)
            arm.data[f"max_abs_diff_vs_{name}"] = diff
            arm.data[f"bitwise_{name}"] = all(torch.equal(x[n], y[n]) for n in x)


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
        help="comma-separated arm names or keys to run (default: all but diloco-ddp and the "
        "compressed ones), e.g. diloco-H25-F1,sparseloco-2%%; diloco-bfloat16 (a bfloat16 "
        "model) and diloco-ddp (learners of 2 DDP ranks) run exact against "
        "reference-bfloat16 and reference-ddp; `compression` names every compressed arm: "
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
    tuning = {"outer_lr": args.sparseloco_outer_lr, "error_decay": args.sparseloco_error_decay}
    if tuning := {k: v for k, v in tuning.items() if v is not None}:
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
        options={NAME: options, "json_path": str(args.json) if args.json is not None else None},
        json_path=args.json,
        md_path=args.md,
    )


if __name__ == "__main__":
    sys.exit(main())
