"""Benchmark 7 — scale: commit latency and the closer's download volume as the number of
learners N grows (2, 4, 8, 16, 32), so that the growth law is visible.

N learners (threads of this process, each with its own model copy and its own
``gm.Session``; the engine of benchmark 3, ``_fleet.py``) train a model of 1M float32
parameters (4 MiB, one fragment) with a cheap fake step, on ``gm.FileMailbox`` in a temporary
directory (``--large`` also on SeaweedFS, started fresh). After a warm-up round, a few
committed rounds are measured per N (bounded by a number of seconds per N).

The fake step sleeps 50 ms and every step is due (sync_every=1): a learner hands its
fragment over at its first step after it applied the last commit. (Benchmark 3's 5 ms step
would let 32 training threads alone keep the GIL busy: rounds then took over 10 s at N=32,
the closer starved of the GIL.)

Measured, per N:

1. commit latency: ``Applied.lag_s`` (from a learner's ``Published`` to its ``Applied``),
   median and min–max over (round, learner) pairs, against a raw put + get of one fragment on
   the same store, measured in the same run;
2. per committed round, what its closer downloaded on its communication thread between its
   claim and its ``rounds/`` record (the other learners' snapshot blobs: N−1 fragments
   expected), and the time from claim to record;
3. bytes and requests per learner per committed round (``session.counters()``).

Then the growth law: ``log y = a + k log N`` fitted by least squares to the medians of each
N, for commit latency, the closer's download and time, and bytes per learner per round.

No target: the exponents are reported as measured. The learners are threads of one process
sharing one GIL (and here 2 cores), so latency growth includes CPU contention.

    .venv/bin/python -m bench scale [--quick | --large]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench._fleet import (
    Result,
    Run,
    file_target,
    mean,
    median,
    phase_table,
    seaweedfs_target,
)

NAME = "scale"
MIB = h.MIB


def defaults(ctx: h.Context) -> argparse.Namespace:
    """The preset's arguments; ``ctx.options["scale"]`` may override any of them."""
    args = argparse.Namespace(
        backends=ctx.pick(["filesystem"], ["filesystem"], ["filesystem", "seaweedfs"]),
        learners=ctx.pick([2, 4, 8, 16, 32], [2, 4, 8, 16], [2, 4, 8, 16, 32]),
        params=1_000_000,
        rounds=ctx.pick(10, 4, 20),
        warmup=1,
        sync_every=1,
        poll_interval=0.5,
        step_ms=50.0,
        reps=ctx.pick(5, 3),
        ref_steps=0,
        max_seconds=ctx.pick(60.0, 15.0, 120.0),
    )
    for key, value in ctx.options.get(NAME, {}).items():
        setattr(args, key, value)
    return args


# -- the growth law --------------------------------------------------------------------------


def fit_power(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of ``log y = a + k log x``: ``(k, exp(a), r2)``; NaN with < 2 points."""
    pts = [
        (math.log(x), math.log(y))
        for x, y in zip(xs, ys, strict=True)
        if x > 0 and y > 0 and math.isfinite(y)
    ]
    if len(pts) < 2:
        return math.nan, math.nan, math.nan
    k, a, r2 = _least_squares(pts)
    return k, math.exp(a), r2


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares of ``y = c + b x``: ``(b, c, r2)``."""
    pts = [(float(x), float(y)) for x, y in zip(xs, ys, strict=True) if math.isfinite(y)]
    if len(pts) < 2:
        return math.nan, math.nan, math.nan
    return _least_squares(pts)


def _least_squares(pts: list[tuple[float, float]]) -> tuple[float, float, float]:
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    syy = sum((y - my) ** 2 for _, y in pts)
    if sxx == 0:
        return math.nan, math.nan, math.nan
    slope = sxy / sxx
    r2 = 1.0 if syy == 0 else sxy * sxy / (sxx * syy)
    return slope, my - slope * mx, r2


# -- running ---------------------------------------------------------------------------------


def run(ctx: h.Context) -> h.Report:
    args = defaults(ctx)
    workdir = ctx.workdir / f"scale-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    results: list[Result] = []
    for backend in args.backends:
        opener: Any = (
            seaweedfs_target(workdir, prefix="scale")
            if backend == "seaweedfs"
            else file_target(workdir)
        )
        with opener as target:
            for n in args.learners:
                results.append(Run(args, target, n, 1, args.params).execute())
    return build_report(results, args)


# -- the report ------------------------------------------------------------------------------


def _frag(r: Result, values: Sequence[float]) -> float:
    """The mean over rounds, in fragments."""
    return mean(values) / r.fragment_bytes


def _signed(value: float, show: Any) -> str:
    return f"-{show(-value)}" if value < 0 else show(value)


def build_report(results: list[Result], args: argparse.Namespace) -> h.Report:
    report = h.Report(
        NAME,
        "7. Scale: commit latency and the closer's download as the learner count grows",
        "a raw put + get of one fragment on the same store, measured in the same run; the "
        "N−1 fragments a closer must read",
    )
    params = results[0].params if results else args.params
    fragment = results[0].fragment_bytes if results else 4.0 * args.params
    partial = any(r.partial for r in results)
    table = report.table(
        f"Per committed round, N learners (threads), {params / 1e6:.2f}M float32 params in one "
        f"fragment ({h.size(fragment)}); sync_every={args.sync_every}, poll_interval="
        f"{args.poll_interval} s, fake step {args.step_ms:g} ms",
        [
            "backend",
            "N",
            "rounds",
            "commit latency, median (min–max)",
            "raw put+get",
            "ratio",
            "closer download / round",
            "snapshots, fragments (N−1)",
            "momentum, fragments",
            "closer time / round (claim -> record)",
            "up+down / learner / round",
            "requests / learner / round",
            "s / round",
            f"CPU busy (of {os.cpu_count()} cores)",
            "CPU / learner / round",
        ],
        note=(
            "Closer download: every byte the round's closer read on its communication thread "
            "between its claim and its `rounds/` record, mean over rounds (in fragments in "
            "brackets); of which the other learners' snapshot blobs (N−1 expected) and the "
            "momentum blob (read when the previous round was closed by another learner, so "
            "not in the closer's cache). Raw "
            "put+get: one fragment, write + fsync + read (filesystem) or boto3 put_object + "
            f"get_object (SeaweedFS), median of {args.reps}, in the same run as that row. "
            "CPU busy: this process's CPU time (all threads) over the measured window, over "
            "the window's wall time x the cores (other processes on the machine use the "
            "rest); per learner per round: that CPU time / rounds / N."
            + (
                f" `*`: stopped at {args.max_seconds:g} s before {args.rounds} rounds."
                if partial
                else ""
            )
        ),
    )
    rows: list[dict[str, Any]] = []
    for r in results:
        lag = h.Stats.of(r.lag)
        down = mean(r.closer_down)
        snap = _frag(r, r.closer_snapshot_down)
        table.add(
            r.backend,
            r.learners,
            f"{r.rounds}{'*' if r.partial else ''}",
            h.secs_range(lag),
            h.secs(r.raw),
            h.ratio(lag.median, r.raw, 1),
            f"{h.size(down)} ({down / r.fragment_bytes:.2f})",
            f"{snap:.2f} ({r.learners - 1})",
            f"{_frag(r, r.closer_momentum_down):.2f}",
            h.secs_range(h.Stats.of(r.closer_seconds)),
            h.size(r.up_down),
            f"{r.requests:.1f}",
            f"{r.seconds / r.rounds:.2f}",
            h.pct(r.cpu_seconds, r.seconds * (os.cpu_count() or 1)),
            h.secs(r.cpu_seconds / r.rounds / r.learners),
        )
        rows.append(
            {
                "backend": r.backend,
                "learners": r.learners,
                "params": r.params,
                "fragment_bytes": r.fragment_bytes,
                "rounds": r.rounds,
                "partial": r.partial,
                "seconds": r.seconds,
                "latency_s": lag.__dict__,
                "lag_s": r.lag,
                "raw_put_get_s": r.raw,
                "closer_down_bytes": r.closer_down,
                "closer_snapshot_down_bytes": r.closer_snapshot_down,
                "closer_momentum_down_bytes": r.closer_momentum_down,
                "closer_seconds": r.closer_seconds,
                "bytes_per_learner_round": r.up_down,
                "requests_per_learner_round": r.requests,
                "cpu_seconds": r.cpu_seconds,
                "requests_by": r.requests_by,
                "phases_median_s": {k: median(v) for k, v in r.phases.items()},
                "skipped_syncs": r.skipped,
                "errors": r.errors,
            }
        )

    phase_table(
        report,
        results,
        [f"{r.backend} N={r.learners}" for r in results],
        "commit latency",
        "As in benchmark 3: from a learner's snapshot record to the last contributor's; "
        "to the closer's claim; the closer's blob transfers, and the rest of its work "
        "until its `rounds/` record; until each syncer reads that record (it polls every "
        "poll_interval); its params download; until the training thread applied it.",
    )

    fits: dict[str, dict[str, Any]] = {}
    table = report.table(
        "Growth law: log y = a + k log N, least squares over the medians of each N",
        [
            "backend",
            "quantity",
            "k (exponent)",
            "R²",
            "local k, each doubling of N",
            "measured, smallest -> largest N",
            "linear fit y = c + b x N",
        ],
        note=(
            "k = 1: linear in N; k = 0: flat. Local k: log(y2/y1) / log(N2/N1) between "
            "successive N, which shows where a curve bends. Medians for latency and closer "
            "time, means over "
            "rounds for the closer's download. b: the cost of one more learner. The closer's "
            "snapshot reads are fitted against N−1, the number of snapshots it must read "
            "(k = 1 when it reads each once)."
        ),
    )
    for backend in dict.fromkeys(r.backend for r in results):
        mine = sorted((r for r in results if r.backend == backend), key=lambda r: r.learners)
        ns = [float(r.learners) for r in mine]
        quantities: list[tuple[str, list[float], list[float], str]] = [
            ("commit latency", ns, [median(r.lag) for r in mine], "s"),
            ("closer download", ns, [mean(r.closer_down) for r in mine], "B"),
            (
                "closer snapshot reads vs N−1",
                [n - 1 for n in ns],
                [mean(r.closer_snapshot_down) for r in mine],
                "B",
            ),
            ("closer time", ns, [median(r.closer_seconds) for r in mine], "s"),
            ("up+down / learner / round", ns, [r.up_down for r in mine], "B"),
            ("requests / learner / round", ns, [r.requests for r in mine], ""),
        ]
        fits[backend] = {}
        for label, xs, ys, unit in quantities:
            k, _, r2 = fit_power(xs, ys)
            b, c, lr2 = fit_line(ns, ys)
            show = {"s": h.secs, "B": h.size}.get(unit, lambda v: f"{v:.1f}")
            span = f"{show(ys[0])} -> {show(ys[-1])}" if ys else "-"
            line = (
                f"c = {_signed(c, show)}, b = {_signed(b, show)} (R² {lr2:.2f})"
                if math.isfinite(b)
                else "-"
            )
            local = [
                math.log(y2 / y1) / math.log(x2 / x1)
                for x1, x2, y1, y2 in zip(xs, xs[1:], ys, ys[1:], strict=False)
                if min(x1, x2, y1, y2) > 0 and x1 != x2
            ]
            table.add(
                backend,
                label,
                f"{k:.2f}",
                f"{r2:.2f}",
                ", ".join(f"{v:.2f}" for v in local) or "-",
                span,
                line,
            )
            fits[backend][label] = {
                "k": k,
                "r2": r2,
                "linear_b": b,
                "linear_c": c,
                "linear_r2": lr2,
                "local_k": local,
                "x": xs,
                "y": ys,
            }
        lat = fits[backend]["commit latency"]
        dl = fits[backend]["closer snapshot reads vs N−1"]
        ratios = [_frag(r, r.closer_snapshot_down) / max(r.learners - 1, 1) for r in mine]
        report.notes.append(
            f"{backend}: closer download grows as N^{fits[backend]['closer download']['k']:.2f}, "
            f"its snapshot reads as (N−1)^{dl['k']:.2f}, and are "
            f"{min(ratios, default=math.nan):.2f}–{max(ratios, default=math.nan):.2f}x the "
            f"N−1 fragments expected. Commit latency grows as N^{lat['k']:.2f} "
            f"(R² {lat['r2']:.2f}); linear: {_signed(lat['linear_c'], h.secs)} + "
            f"{_signed(lat['linear_b'], h.secs)} per learner (R² {lat['linear_r2']:.2f})."
        )
    report.notes.append(
        "No target for scale: the exponents are reported as measured. The learners are "
        "threads of one process sharing one GIL and this machine's cores, so latency growth "
        "includes CPU contention (N training threads plus 2N session threads), not only the "
        "protocol's cost; the closer's download volume does not depend on it."
    )
    for r in results:
        report.notes.append(
            f"{r.backend} N={r.learners}: {r.rounds} rounds in {r.seconds:.1f} s "
            f"({r.seconds / r.rounds:.2f} s/round), {r.skipped} due syncs skipped "
            f"(fragment still in flight), {r.closes:.2f} closes per round"
        )
        for error in r.errors:
            report.notes.append(f"ERROR {r.backend} N={r.learners}: {error}")
    report.data = {"args": vars(args), "configs": rows, "fits": fits}
    return report
