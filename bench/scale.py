"""Benchmark 7 — scale: DiLoCo and Moshpit side by side as the number of learners N grows
(2, 4, 8, 16, 32, 64, 128): commit latency, the busiest learner's download per round and
requests per learner per round, with their growth law.

N learners — **threads of this one process**, each with its own model copy and its own
``gm.Session`` (the engine of benchmark 3, ``_fleet.py``) — train a tiny model of **51,840
float32 parameters** (8 × ``Linear(80, 80)``, 202.5 KiB, one fragment; small so that 128
copies and their snapshots fit here) with a cheap fake step. Each N runs twice:

- **DiLoCo** (``gm.DiLoCo(sync_every=1)``): every round, one closer downloads the other N−1
  learners' snapshots; everyone else downloads the one commit;
- **Moshpit** (``gm.Moshpit(sync_every=1, group_size=M, grid_dims=d)``) with M = 2 and
  d = log2 N: a full grid (M^d = N, one learner per cell) at every N, groups of 2; each
  group round, every group's closer downloads its M−1 = 1 other member's snapshot, the
  other member downloads the group's average. ``group_sizes=[2, 4]`` (``--group-sizes
  2,4``) adds M = 4 where N is a power of 4 (4, 16, 64).

The store is ``gm.MemoryMailbox`` by default (in this process: no I/O, no thread hops), so
that N = 128 fits in the time here: on ``gm.FileMailbox`` (``--backends filesystem``; the
store of this benchmark before Moshpit) 128 DiLoCo learners of one process on 2 cores did not
commit one round in 150 s — every learner lists ``leases/`` and the round's keys at each
poll, O(N) keys each, so the process's CPU goes to O(N²) listing and the closer starves.
``--large`` runs memory, filesystem and SeaweedFS.

The fake step sleeps 50 ms and every step is a sync point (sync_every=1; ``step()`` waits for
its round's commit), so a learner's step count is its round. After a warm-up round, 8
committed rounds are measured per configuration, at most ``max_seconds`` (75 s) from the
start of training (then the window holds what committed; with none after the warm-up, the
warm-up round is measured; ``*`` marks it). Then the learners *drain* (each trains on to the
highest step count any had started, 60 s at most), so that no round is left to time out.
``round_timeout`` is 60 s, ``lease_timeout`` 60 s and ``claim_timeout`` 300 s, far above a
round's time, so a group of a full grid should never close by timeout nor a claim fail
over: the missed groups (``GroupMissed``), group records with fewer than M members, claims
won at attempt >= 1, failure events and waits that timed out are counted to show it.
``keep_rounds`` is the Session's default (2) unless ``keep_rounds`` is given (``safe``:
``grid_dims - 1`` for Moshpit: what it took before the engine kept ``grid_dims`` more group
rounds itself, after this benchmark caught a closer sweeping a round that a lagging group
member still needed; kept to compare with runs made before).

Measured, per N and algorithm:

1. commit latency: ``Applied.lag_s`` (from a learner's sync point to its ``Applied``),
   median over (round, learner) pairs of the window;
2. the busiest learner's download per round: what a round's closer (DiLoCo) or a group's
   closer (Moshpit) downloaded between its successful claim and its record, mean over the
   window's closings, and how many distinct snapshot payloads that was (N−1 and M−1
   expected); beside it the busiest learner's own counters (its bytes down / rounds);
3. requests, bytes and listed keys per learner per round, CPU seconds, seconds per round.

Then the growth law, ``log y = a + k log N`` fitted by least squares to the values of each
N, per algorithm. The issue's target: Moshpit's busiest download and latency flat in N
(k <= 0.1), where DiLoCo's closer download grows as N. The learners are threads of one
process sharing one GIL on this machine's cores (2 here, shared with other work): latency
and seconds per round include that CPU contention (N training threads, and per learner a
communication and a sync thread polling the store), which grows with N for both
algorithms; the bytes and the payload counts do not depend on it.

    .venv/bin/python -m bench scale [--quick | --large]
    .venv/bin/python -m bench.scale [--quick] [--backends memory,filesystem]
        [--learners 2,4,8] [--group-sizes 2,4] [--keep-rounds safe]
        [--markdown out.md] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeGuard

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail as gm
from bench import _harness as h
from bench._fleet import (
    Result,
    Run,
    file_target,
    memory_target,
    phase_table,
    seaweedfs_target,
)

NAME = "scale"
MIB = h.MIB
DILOCO = "diloco"
MOSHPIT = "moshpit"


def defaults(ctx: h.Context) -> argparse.Namespace:
    """The preset's arguments; ``ctx.options["scale"]`` may override any of them."""
    args = argparse.Namespace(
        backends=ctx.pick(["memory"], ["memory"], ["memory", "filesystem", "seaweedfs"]),
        learners=ctx.pick([2, 4, 8, 16, 32, 64, 128], [2, 4, 8]),
        algorithms=[DILOCO, MOSHPIT],
        group_sizes=[2],  # Moshpit's M, each with grid_dims = log_M N (full grids only)
        params=51_840,  # 8 x Linear(80, 80): 202.5 KiB of float32
        rounds=ctx.pick(8, 3, 20),
        warmup=1,
        sync_every=1,
        poll_interval=0.5,
        step_ms=50.0,
        round_timeout=60.0,
        lease_timeout=60.0,
        claim_timeout=300.0,
        drain_seconds=60.0,
        keep_rounds=None,  # Session's keep_rounds: None (its default, 2), an int, or "safe"
        reps=ctx.pick(5, 3),
        ref_steps=0,
        max_seconds=ctx.pick(75.0, 20.0, 150.0),
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


# -- the configurations ----------------------------------------------------------------------


def grid_dims(n: int, group_size: int) -> int | None:
    """``d`` with ``group_size ** d == n`` (a full grid), else None."""
    d = max(1, round(math.log(n) / math.log(group_size)))
    return d if group_size**d == n else None


def variant(r: Result) -> str:
    """A run's algorithm as the tables name it: ``diloco`` or ``moshpit M=2``."""
    return r.label or r.algorithm


def keep_rounds(args: argparse.Namespace, algorithm: gm.Algorithm | None) -> int | None:
    """The ``keep_rounds`` of a run's sessions: ``args.keep_rounds`` (None: the Session's
    default); ``"safe"``: ``grid_dims - 1`` (at least 2) for Moshpit, the default for
    DiLoCo. (With fewer, a Moshpit closer of round t + d - 1 may sweep round t while a
    member of a round-t group has not read its group's record yet: see the report.)"""
    value = args.keep_rounds
    if value == "safe":
        return max(2, algorithm.grid_dims - 1) if isinstance(algorithm, gm.Moshpit) else None
    return None if value is None else int(value)


def configurations(args: argparse.Namespace, n: int) -> list[tuple[str, gm.Algorithm | None]]:
    """(label, algorithm) of each run at ``n`` learners (None: the fleet's DiLoCo)."""
    runs: list[tuple[str, gm.Algorithm | None]] = []
    if DILOCO in args.algorithms:
        runs.append((DILOCO, None))
    if MOSHPIT in args.algorithms:
        for m in args.group_sizes:
            d = grid_dims(n, m)
            if d is not None:
                algorithm = gm.Moshpit(sync_every=args.sync_every, group_size=m, grid_dims=d)
                runs.append((f"{MOSHPIT} M={m}", algorithm))
    return runs


# -- running ---------------------------------------------------------------------------------


def run(ctx: h.Context) -> h.Report:
    args = defaults(ctx)
    workdir = ctx.workdir / f"scale-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    results: list[Result] = []
    options = {
        "round_timeout": args.round_timeout,
        "lease_timeout": args.lease_timeout,
        "claim_timeout": args.claim_timeout,
    }
    for backend in args.backends:
        opener: Any = (
            seaweedfs_target(workdir, prefix="scale")
            if backend == "seaweedfs"
            else memory_target()
            if backend == "memory"
            else file_target(workdir)
        )
        with opener as target:
            for n in args.learners:
                for label, algorithm in configurations(args, n):
                    keep = keep_rounds(args, algorithm)
                    fleet = Run(
                        args,
                        target,
                        n,
                        1,
                        args.params,
                        algorithm=algorithm,
                        label=label if algorithm is not None else "",
                        session_options=options | ({} if keep is None else {"keep_rounds": keep}),
                        drain=True,
                    )
                    results.append(fleet.execute())
    return build_report(results, args)


# -- the report ------------------------------------------------------------------------------


def _signed(value: float, show: Any) -> str:
    return f"-{show(-value)}" if value < 0 else show(value)


def expected_payloads(r: Result) -> int:
    """Snapshot payloads a closing's closer reads: the other members of its round or group."""
    if r.algorithm == MOSHPIT:
        return int(r.label.rpartition("M=")[2] or 2) - 1
    return r.learners - 1


def short_groups(r: Result) -> int:
    """Moshpit groups of the window whose record lists fewer than M members (closed by
    ``round_timeout`` with whoever came, or with a member thought dead)."""
    if r.algorithm != MOSHPIT:
        return 0
    m = expected_payloads(r) + 1
    return sum(1 for members in r.group_members if members < m)


def busiest(r: Result) -> float:
    """The busiest learner's download per round: a closing's closer's, mean over closings."""
    return h.mean(r.closer_down)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and math.isfinite(a) and math.isfinite(b) else "-"


def build_report(results: list[Result], args: argparse.Namespace) -> h.Report:
    report = h.Report(
        NAME,
        "7. Scale: DiLoCo and Moshpit side by side as the learner count grows",
        "DiLoCo at the same N, in the same run (ratio columns: Moshpit / DiLoCo); a raw put + "
        "get of one fragment on the same store",
    )
    params = results[0].params if results else args.params
    fragment = results[0].fragment_bytes if results else 4.0 * args.params
    cores = os.cpu_count() or 1
    partial = any(r.partial for r in results)
    setting = (
        f"N learners = threads of one process, each its own gm.Session; {params:,} float32 "
        f"params ({h.size(fragment)}, one fragment); sync_every={args.sync_every}, fake step "
        f"{args.step_ms:g} ms, poll_interval={args.poll_interval} s, round_timeout="
        f"{args.round_timeout:g} s, lease_timeout={args.lease_timeout:g} s, keep_rounds="
        f"{'Session default (2)' if args.keep_rounds is None else args.keep_rounds}"
    )
    by: dict[tuple[str, int, str], Result] = {
        (r.backend, r.learners, variant(r)): r for r in results
    }
    moshpits = sorted({variant(r) for r in results if r.algorithm == MOSHPIT})

    # -- 1. side by side -----------------------------------------------------------------
    table = report.table(
        f"DiLoCo vs Moshpit per round. {setting}",
        [
            "backend",
            "N",
            "Moshpit",
            "latency DiLoCo",
            "latency Moshpit",
            "ratio",
            "busiest download DiLoCo (N−1 snapshots)",
            "busiest download Moshpit (M−1 snapshots)",
            "ratio",
            "requests / learner DiLoCo",
            "requests / learner Moshpit",
            "ratio",
            "listed keys / learner DiLoCo",
            "listed keys / learner Moshpit",
            "s / round DiLoCo",
            "s / round Moshpit",
            "missed groups",
            "groups < M members",
            "failovers (D / M)",
            "wait timeouts (D / M)",
        ],
        note=(
            "Latency: median `Applied.lag_s` over (round, learner) pairs of the measured "
            "window. Busiest download: what one closing's closer downloaded between its "
            "claim and its record (DiLoCo: the round's closer; Moshpit: a group's closer), "
            "mean over the window's closings, with the distinct snapshot payloads it read "
            "in brackets. Requests: all store calls per learner per round (window deltas of "
            "`session.counters()`). Listed keys: keys all listings returned, per learner "
            "per round (their bytes are not in the counters). A Moshpit round is a group "
            "round. Missed groups: `GroupMissed` events (a contribution that came after its "
            "group closed) of the window's rounds, in brackets over the whole run (drain "
            "included); groups < M members: group records of the window listing fewer than "
            "M (closed by round_timeout, or without a member thought dead), in brackets over "
            "the whole run; failovers: claims won at attempt >= 1 over the whole run (a "
            "closer's claim no longer honoured); wait timeouts: step() waits that gave up."
            + (
                f" `*`: stopped at {args.max_seconds:g} s before {args.rounds} rounds."
                if partial
                else ""
            )
        ),
    )
    rows: list[dict[str, Any]] = []
    for backend in dict.fromkeys(r.backend for r in results):
        for n in sorted({r.learners for r in results if r.backend == backend}):
            d = by.get((backend, n, DILOCO))
            here: list[str | None] = [mv for mv in moshpits if (backend, n, mv) in by]
            for mv in here or [None]:
                m = by.get((backend, n, mv)) if mv is not None else None
                if d is None and m is None:
                    continue
                table.add(
                    backend,
                    n,
                    _grid(m) if m else "-",
                    _lat(d),
                    _lat(m),
                    _ratio(h.median(m.lag), h.median(d.lag)) if d and m else "-",
                    _dl(d),
                    _dl(m),
                    _ratio(busiest(m), busiest(d)) if _measured(d) and _measured(m) else "-",
                    _requests(d),
                    _requests(m),
                    _ratio(m.requests, d.requests) if _measured(d) and _measured(m) else "-",
                    f"{d.listed_keys:.0f}" if _measured(d) else "-",
                    f"{m.listed_keys:.0f}" if _measured(m) else "-",
                    _per_round(d),
                    _per_round(m),
                    f"{m.missed_groups} ({m.missed_total})" if m else "-",
                    f"{short_groups(m)} of {len(m.group_members)} ({m.short_groups_total})"
                    if m
                    else "-",
                    f"{d.failovers if d else '-'} / {m.failovers if m else '-'}",
                    f"{d.wait_timeouts if d else '-'} / {m.wait_timeouts if m else '-'}",
                )

    # -- 2. every run --------------------------------------------------------------------
    table = report.table(
        f"Every run. {setting}",
        [
            "backend",
            "algorithm",
            "N",
            "rounds",
            "commit latency, median (min–max)",
            "raw put+get",
            "closings",
            "closer download / closing (fragments)",
            "snapshot payloads read / closing (expected)",
            "closer time / closing (claim -> record)",
            "busiest learner, down / round (counters)",
            "up+down / learner / round",
            "requests / learner / round",
            "listed keys / learner / round",
            "closes / round",
            "s / round",
            f"CPU busy (of {cores} cores)",
            "CPU / learner / round",
            "failure events",
        ],
        note=(
            "Closings: DiLoCo rounds, or Moshpit groups, of the window whose claim and record "
            "were both seen. Closer download: every byte the closer read on its communication "
            "thread between its successful claim and its record. Snapshot payloads read: "
            "distinct snapshot payloads among them, min–max over closings. Busiest learner "
            "(counters): the largest bytes-down window delta of one learner, over rounds. "
            "CPU busy: this process's CPU time (all threads) over the window's wall time x "
            "the cores (other processes on the machine use the rest). Failure events: "
            "PublishFailed, RoundFailed and PollFailed events over the whole run."
        ),
    )
    for r in results:
        lag = h.Stats.of(r.lag)
        down = busiest(r)
        payloads = r.closer_snapshot_payloads
        span = f"{min(payloads)}–{max(payloads)}" if payloads else "-"
        table.add(
            r.backend,
            _name(r),
            r.learners,
            f"{r.committed_rounds}{'*' if r.partial else ''}",
            h.secs_range(lag),
            h.secs(r.raw),
            len(r.closer_down),
            f"{h.size(down)} ({down / r.fragment_bytes:.2f})",
            f"{span} ({expected_payloads(r)})",
            h.secs_range(h.Stats.of(r.closer_seconds)),
            h.size(r.busiest_down),
            h.size(r.up_down),
            f"{r.requests:.1f}",
            f"{r.listed_keys:.0f}",
            f"{r.closes:.2f}",
            _per_round(r),
            h.pct(r.cpu_seconds, r.seconds * cores),
            h.secs(r.cpu_seconds / r.rounds / r.learners),
            r.failures,
        )
        rows.append(
            {
                "backend": r.backend,
                "algorithm": r.algorithm,
                "variant": variant(r),
                "learners": r.learners,
                "params": r.params,
                "fragment_bytes": r.fragment_bytes,
                "rounds": r.committed_rounds,
                "partial": r.partial,
                "seconds": r.seconds,
                "latency_s": lag.__dict__,
                "lag_s": r.lag,
                "raw_put_get_s": r.raw,
                "closer_down_bytes": r.closer_down,
                "closer_snapshot_down_bytes": r.closer_snapshot_down,
                "closer_momentum_down_bytes": r.closer_momentum_down,
                "closer_snapshot_payloads": r.closer_snapshot_payloads,
                "expected_snapshot_payloads": expected_payloads(r),
                "group_members": r.group_members,
                "closer_seconds": r.closer_seconds,
                "busiest_down_bytes_per_round": r.busiest_down,
                "bytes_per_learner_round": r.up_down,
                "requests_per_learner_round": r.requests,
                "closes_per_round": r.closes,
                "cpu_seconds": r.cpu_seconds,
                "requests_by": r.requests_by,
                "phases_median_s": {k: h.median(v) for k, v in r.phases.items()},
                "missed_groups": r.missed_groups,
                "missed_groups_total": r.missed_total,
                "short_groups": short_groups(r),
                "short_groups_total": r.short_groups_total,
                "failovers": r.failovers,
                "undrained": r.undrained,
                "listed_keys_per_learner_round": r.listed_keys,
                "wait_timeouts": r.wait_timeouts,
                "failures": r.failures,
                "skipped_syncs": r.skipped,
                "errors": r.errors,
            }
        )

    diloco = [r for r in results if r.algorithm == DILOCO]
    if diloco:
        phase_table(
            report,
            diloco,
            [f"{r.backend} N={r.learners}" for r in diloco],
            "commit latency",
            "DiLoCo only, as in benchmark 3: from a learner's snapshot record to the last "
            "contributor's; to the closer's claim; the closer's blob transfers, and the rest "
            "of its work until its `rounds/` record; until each syncer reads that record (it "
            "polls every poll_interval); its params download; until the training thread "
            "applied it.",
        )

    # -- 3. the growth law ---------------------------------------------------------------
    fits: dict[str, dict[str, dict[str, Any]]] = {}
    table = report.table(
        "Growth law: log y = a + k log N, least squares over the values of each N",
        [
            "backend",
            "algorithm",
            "quantity",
            "k (exponent)",
            "R²",
            "local k, each step of N",
            "measured, smallest -> largest N",
            "linear fit y = c + b x N",
        ],
        note=(
            "k = 1: linear in N; k = 0: flat; the issue's target for Moshpit's busiest "
            "download and latency is k <= 0.1. Local k: log(y2/y1) / log(N2/N1) between "
            "successive N, which shows where a curve bends. Latency: medians; busiest "
            "download: means over closings. b: the cost of one more learner."
        ),
    )
    quantities: list[tuple[str, Any, str]] = [
        ("commit latency", lambda r: h.median(r.lag), "s"),
        ("busiest download / round", busiest, "B"),
        ("requests / learner / round", lambda r: r.requests, ""),
        ("listed keys / learner / round", lambda r: r.listed_keys, ""),
        ("up+down / learner / round", lambda r: r.up_down, "B"),
        ("closer time", lambda r: h.median(r.closer_seconds), "s"),
        ("s / round", lambda r: r.seconds / r.rounds, "s"),
        ("CPU / learner / round", lambda r: r.cpu_seconds / r.rounds / r.learners, "s"),
    ]
    for backend in dict.fromkeys(r.backend for r in results):
        for name in dict.fromkeys(variant(r) for r in results if r.backend == backend):
            mine = sorted(
                (
                    r
                    for r in results
                    if r.backend == backend and variant(r) == name and _measured(r)
                ),
                key=lambda r: r.learners,
            )
            ns = [float(r.learners) for r in mine]
            key = f"{backend} {name}"
            fits[key] = {}
            for label, get, unit in quantities:
                ys = [float(get(r)) for r in mine]
                k, _, r2 = fit_power(ns, ys)
                b, c, lr2 = fit_line(ns, ys)
                show: Callable[[float], str] = {"s": h.secs, "B": h.size}.get(unit, _plain)
                span = f"{show(ys[0])} -> {show(ys[-1])}" if ys else "-"
                line = (
                    f"c = {_signed(c, show)}, b = {_signed(b, show)} (R² {lr2:.2f})"
                    if math.isfinite(b)
                    else "-"
                )
                local = [
                    math.log(y2 / y1) / math.log(x2 / x1)
                    for x1, x2, y1, y2 in zip(ns, ns[1:], ys, ys[1:], strict=False)
                    if min(x1, x2, y1, y2) > 0 and x1 != x2
                ]
                table.add(
                    backend,
                    name,
                    label,
                    f"{k:.2f}",
                    f"{r2:.2f}",
                    ", ".join(f"{v:.2f}" for v in local) or "-",
                    span,
                    line,
                )
                fits[key][label] = {
                    "k": k,
                    "r2": r2,
                    "linear_b": b,
                    "linear_c": c,
                    "linear_r2": lr2,
                    "local_k": local,
                    "x": ns,
                    "y": ys,
                }
            if name.startswith(MOSHPIT) and len(mine) >= 2:
                for label in ("busiest download / round", "commit latency"):
                    k = fits[key][label]["k"]
                    report.target(
                        f"{key}: {label} flat in N",
                        f"k = {k:.2f} over N = {mine[0].learners}..{mine[-1].learners}",
                        "k <= 0.1",
                        bool(k <= 0.1) if math.isfinite(k) else None,
                        ""
                        if label.startswith("busiest")
                        else "threads of one process: includes the GIL's and the cores' "
                        "contention, which grows with N",
                    )

    report.notes.append(
        "Bytes and payload counts are protocol properties (a DiLoCo closer reads N−1 "
        "snapshots, a Moshpit group closer M−1); latency and seconds per round are not only "
        "the protocol's: the learners are threads of one process sharing one GIL on "
        f"{cores} cores (shared with other work on this machine), so they include CPU "
        "contention that grows with N (N training threads plus 2N session threads) for both "
        "algorithms. Moshpit's latency also has a floor of about poll_interval: the member "
        "that published first finds its group's record at its next poll of the "
        "communication thread, while DiLoCo's syncer polls from a few milliseconds up."
    )
    for r in results:
        top = sorted(r.requests_by.items(), key=lambda kv: -kv[1])[:3]
        report.notes.append(
            f"{r.backend} N={r.learners} {_name(r)}: {r.committed_rounds} rounds in "
            f"{r.seconds:.1f} s, {len(r.closer_down)} closings, {r.closes:.2f} closes per "
            f"round, {r.skipped} due syncs skipped, {r.failures} failure events, "
            f"{r.failovers} failovers; most requests / learner / round: "
            + ", ".join(f"{kind} {value:.1f}" for kind, value in top)
            + (f"; {r.undrained} learners still in step() after the drain" if r.undrained else "")
            + (
                ""
                if _measured(r)
                else ": NO round committed within max_seconds (left out of the fits)"
            )
        )
        for error in r.errors[:3]:
            report.notes.append(f"ERROR {r.backend} N={r.learners} {_name(r)}: {error}")
        if len(r.errors) > 3:
            report.notes.append(
                f"ERROR {r.backend} N={r.learners} {_name(r)}: {len(r.errors) - 3} more errors"
            )
    report.data = {"args": vars(args), "configs": rows, "fits": fits}
    return report


def _plain(value: float) -> str:
    return f"{value:.1f}"


def _name(r: Result) -> str:
    if r.algorithm == MOSHPIT:
        m = expected_payloads(r) + 1
        return f"{variant(r)} d={grid_dims(r.learners, m)}"
    return variant(r)


def _grid(r: Result) -> str:
    m = expected_payloads(r) + 1
    return f"M={m}, d={grid_dims(r.learners, m)}"


def _measured(r: Result | None) -> TypeGuard[Result]:
    """Whether ``r`` committed a round in its window (else its per-round numbers are not)."""
    return r is not None and r.committed_rounds > 0


def _lat(r: Result | None) -> str:
    return h.secs(h.median(r.lag)) if r is not None and r.lag else "-"


def _requests(r: Result | None) -> str:
    return f"{r.requests:.1f}" if r is not None and _measured(r) else "-"


def _dl(r: Result | None) -> str:
    if r is None or not r.closer_down:
        return "-"
    payloads = r.closer_snapshot_payloads
    return f"{h.size(busiest(r))} ({h.mean([float(x) for x in payloads]):.2f})"


def _per_round(r: Result | None) -> str:
    if r is None:
        return "-"
    if not _measured(r):
        return f"none in {r.seconds:.0f} s*"
    return f"{r.seconds / r.rounds:.2f}{'*' if r.partial else ''}"


# -- on its own ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="N = 2, 4, 8: under a minute")
    size.add_argument("--large", action="store_true", help="also on SeaweedFS, more rounds")
    parser.add_argument("--learners", default=None, help="learner counts, e.g. 2,4,8")
    parser.add_argument("--group-sizes", default=None, help="Moshpit's M, e.g. 2,4 (default 2)")
    parser.add_argument(
        "--backends", default=None, help="filesystem, memory, seaweedfs (default: filesystem)"
    )
    parser.add_argument("--algorithms", default=None, help="diloco,moshpit (default: both)")
    parser.add_argument("--rounds", type=int, default=None, help="committed rounds measured")
    parser.add_argument("--warmup", type=int, default=None, help="rounds before measuring")
    parser.add_argument(
        "--keep-rounds",
        default=None,
        help="Session keep_rounds: an int, or 'safe' (Moshpit: grid_dims - 1); default: its own",
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="per configuration")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the report")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON record")
    parsed = parser.parse_args(argv)
    options: dict[str, Any] = {}
    if parsed.learners:
        options["learners"] = [int(x) for x in parsed.learners.split(",") if x.strip()]
    if parsed.group_sizes:
        options["group_sizes"] = [int(x) for x in parsed.group_sizes.split(",") if x.strip()]
    if parsed.backends:
        options["backends"] = [x.strip() for x in parsed.backends.split(",") if x.strip()]
    if parsed.algorithms:
        options["algorithms"] = [x.strip() for x in parsed.algorithms.split(",") if x.strip()]
    if parsed.keep_rounds is not None:
        keep = parsed.keep_rounds
        options["keep_rounds"] = keep if keep == "safe" else int(keep)
    if parsed.warmup is not None:
        options["warmup"] = parsed.warmup
    if parsed.rounds is not None:
        options["rounds"] = parsed.rounds
    if parsed.max_seconds is not None:
        options["max_seconds"] = parsed.max_seconds
    info = h.machine()
    command = "python -m bench.scale " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gm-bench-") as tmp:
        ctx = h.Context(
            quick=parsed.quick, large=parsed.large, workdir=Path(tmp), options={NAME: options}
        )
        report = run(ctx)
    report.seconds = time.monotonic() - started
    info["load_average_after"] = list(os.getloadavg())
    load = ", ".join(f"{x:.2f}" for x in info["load_average_after"])
    text = "\n".join(
        [
            f"# gradientmail benchmark: {NAME}",
            "",
            f"Command: `{command.strip()}`",
            "",
            f"Machine: {h.describe(info)}; load average at the end {load}",
            "",
            report.render(),
            "",
        ]
    )
    print(text, flush=True)
    if parsed.markdown is not None:
        parsed.markdown.parent.mkdir(parents=True, exist_ok=True)
        parsed.markdown.write_text(text)
    if parsed.json is not None:
        parsed.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"machine": info, "report": report.to_json()}
        parsed.json.write_text(json.dumps(record, indent=2, default=repr) + "\n")
    return 0 if report.error is None else 1


if __name__ == "__main__":
    sys.exit(main())
