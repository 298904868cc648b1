"""Benchmark 3 — round cost per learner: bytes, requests and commit latency per committed
round, against the byte lower bound and the raw transfer of the same bytes on the same store,
measured in the same run.

Several learners (threads of this process, each with its own model copy and its own
``gm.Session``) train a model of ``--params`` float32 parameters with a cheap fake step (a
little noise added to every tensor, then a short sleep standing in for accelerator time), so
the run is communication-bound. One mailbox per configuration: SeaweedFS (started fresh by
this benchmark, one prefix per configuration) or ``gm.FileMailbox`` in a temporary
directory. After ``--warmup`` training rounds, ``--rounds`` committed rounds are measured
(twice as many with P > 1 fragments: a round of P fragments carries 1/P of the model).

Measured, per learner and committed round (window deltas of ``session.counters()``):

1. bytes up + down, against the lower bound of one fragment up and one fragment down
   (fragment bytes = parameter bytes / fragments);
2. requests;
3. commit latency: ``Applied.lag_s`` (from this learner's ``Published`` to its ``Applied``),
   median, against a raw put + get of one fragment's bytes on the same store (a plain
   ``boto3`` ``put_object`` + ``get_object`` on SeaweedFS; a file write + fsync + read for the
   filesystem), measured in the same run;
4. time inside ``session.step()`` on the training thread, for calls that snapshot a
   fragment, calls that apply a commit, and plain calls, against a bare training step
   (forward + backward + SGD) of a 1M-parameter MLP at batch 32 on the CPU.

A recording wrapper under each session's mailbox (``_recorder.py``) attributes every byte
to what it carried (snapshot / params / momentum payloads, JSON records) and every round's
latency to its phases (waiting for the other learners, close detection, closer work,
syncer).

Targets: <= 1.2x the byte lower bound, <= 2x the raw transfer time.

The learners, mailboxes and analysis are in ``_fleet.py`` (shared with benchmark 7, ``scale``);
this module builds the report.

    .venv/bin/python -m bench rounds [--quick | --large]
    .venv/bin/python bench/rounds.py [--backends seaweedfs,filesystem] [--learners 2,4]
        [--fragments 1,4] [--params 10M] [--rounds 8] [--warmup 2] [--sync-every 8]
        [--poll-interval 0.5] [--step-ms 5] [--max-seconds 60]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench._fleet import Result, Run, file_target, phase_table, seaweedfs_target
from bench._fleet import mean as _mean
from bench._fleet import median as _median
from bench._workload import BATCH

NAME = "rounds"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# -- the report ------------------------------------------------------------------------------


def _purpose_order(label: str) -> tuple[int, str]:
    order = ("put snapshot", "put params", "put momentum", "get snapshot", "get params")
    for i, prefix in enumerate((*order, "get momentum")):
        if label.startswith(prefix) and "(records)" not in label:
            return (i, label)
    return (len(order) + 1, label)


def _config(r: Result) -> str:
    return f"{r.backend} L={r.learners} P={r.fragments} {r.params / 1e6:.0f}M"


CLOSER_WORK = ("put params", "put momentum", "get snapshot", "get momentum", "get params (by")
CONTRIBUTOR_WORK = ("put snapshot", "get params (sync)")


def star_floor(learners: int) -> float:
    """Bytes per learner per round, in fragments, of a round closed by one learner with no
    momentum blob: each uploads its snapshot; the closer downloads the L-1 others and uploads
    the result; the L-1 others download it: (L + 1 + 2(L-1)) / L = 3 - 1/L."""
    return 3 - 1 / learners


def build_report(results: list[Result], args: argparse.Namespace) -> h.Report:
    report = h.Report(
        NAME,
        "3. Round cost per learner: bytes, requests, commit latency",
        "the byte lower bound (one fragment up + one down per learner per round) and a raw "
        "put + get of one fragment on the same store, measured in this run",
    )
    table = report.table(
        f"Per learner per committed round (sync_every={args.sync_every}, poll_interval="
        f"{args.poll_interval} s, fake step {args.step_ms:g} ms)",
        [
            "backend",
            "L",
            "P",
            "params",
            "rounds",
            "up+down / learner / round",
            "lower bound",
            "ratio (<= 1.2)",
            "floor of 1 closer",
            "requests / round",
            "commit latency (median)",
            "raw put+get",
            "ratio (<= 2)",
            "closes / round",
        ],
        note=(
            "Lower bound: one fragment up + one down (fragment = parameter bytes / fragments). "
            "Floor of 1 closer: what any protocol in which one learner downloads the others' "
            "snapshots and uploads the result moves, averaged over learners, without a "
            "momentum blob: (3 - 1/L)/2 x the bound. Raw put+get: one fragment, boto3 "
            "put_object + get_object (SeaweedFS) or write + fsync + read (filesystem), median "
            "of --reps. `closes / round`: puts of the `rounds/` record per committed round."
            + (
                f" `*`: stopped at --max-seconds={args.max_seconds:g} before --rounds."
                if any(r.partial for r in results)
                else ""
            )
        ),
    )
    rows_json = []
    for r in results:
        bound = 2 * r.fragment_bytes
        lag = _median(r.lag)
        table.add(
            r.backend,
            r.learners,
            r.fragments,
            f"{r.params / 1e6:.1f}M",
            f"{r.rounds}{'*' if r.partial else ''}",
            h.size(r.up_down),
            h.size(bound),
            h.ratio(r.up_down, bound),
            f"{star_floor(r.learners) / 2:.2f}x",
            f"{r.requests:.1f}",
            h.secs(lag),
            h.secs(r.raw),
            h.ratio(lag, r.raw, 1),
            f"{r.closes:.2f}",
        )
        rows_json.append(
            {
                "config": _config(r),
                "backend": r.backend,
                "learners": r.learners,
                "fragments": r.fragments,
                "params": r.params,
                "rounds": r.rounds,
                "partial": r.partial,
                "bytes_per_learner_round": r.up_down,
                "bytes_ratio": r.up_down / bound,
                "requests_per_learner_round": r.requests,
                "latency_median_s": lag,
                "latency_s": h.Stats.of(r.lag).__dict__,
                "raw_put_get_s": r.raw,
                "latency_ratio": lag / r.raw,
                "closes_per_round": r.closes,
                "bytes_by_purpose": r.purposes,
                "requests_by": r.requests_by,
                "phases_median_s": {k: _median(v) for k, v in r.phases.items()},
                "step_s": {k: h.Stats.of(v).__dict__ for k, v in r.steps.items()},
                "skipped_syncs": r.skipped,
                "errors": r.errors,
            }
        )

    pooled = [t for r in results for t in r.ref_step]
    ref = _median(pooled)
    table = report.table(
        f"step() on the training thread (fake training), against a bare step of the 1M-param "
        f"MLP (batch {BATCH}, CPU): median {h.secs(ref)} over {len(pooled)} steps",
        [
            "config",
            "snapshot calls (n, median)",
            "apply calls (n, median)",
            "plain calls (n, median)",
            "mean, all calls",
            "vs bare step",
        ],
        note=(
            "Learners are threads of one process here, so calls also wait for the GIL; "
            "benchmark 4 measures step() in processes of their own."
        ),
    )
    for r in results:
        cells = [
            f"{len(r.steps.get(k, []))}, {h.secs(_median(r.steps.get(k, [])))}"
            for k in ("snapshot", "apply", "plain")
        ]
        every = [v for values in r.steps.values() for v in values]
        table.add(_config(r), *cells, h.secs(_mean(every)), h.pct(_mean(every), ref))

    labels = sorted({k for r in results for k in r.purposes}, key=_purpose_order)
    table = report.table(
        "Where the bytes go: per learner per committed round, in fragments "
        "(lower bound: 1.00 up + 1.00 down = 2.00)",
        ["what (direction)", *(_config(r) for r in results)],
        note=(
            "snapshot blobs: each learner's contribution (up) and the closer reading the "
            "others' (down). params / momentum blobs: the closer's commit (up); read back by "
            "the other learners' syncers (`get params (sync)`), by a closer for its own round "
            "(`by its closer`), and momentum by a closer whose cache does not hold the base "
            "round's momentum."
        ),
    )
    for label in labels:
        if all(r.purposes.get(label, 0.0) / r.fragment_bytes < 0.005 for r in results):
            continue
        table.add(label, *(f"{r.purposes.get(label, 0.0) / r.fragment_bytes:.2f}" for r in results))
    small = [
        sum(v for k, v in r.purposes.items() if "(records)" in k) / r.fragment_bytes
        for r in results
    ]
    table.add("JSON records, all kinds", *(f"{v:.3f}" for v in small))

    def role(r: Result, prefixes: Sequence[str]) -> float:
        picked = sum(v for k, v in r.purposes.items() if k.startswith(tuple(prefixes)))
        return picked / r.fragment_bytes

    table.add("= closer's work", *(f"{role(r, CLOSER_WORK):.2f}" for r in results))
    table.add("= every contributor's work", *(f"{role(r, CONTRIBUTOR_WORK):.2f}" for r in results))
    table.add("total", *(f"{sum(r.purposes.values()) / r.fragment_bytes:.2f}" for r in results))
    table.add(
        "(recorder / counters)",
        *(f"{r.recorder_total / max(r.counters_total, 1):.3f}" for r in results),
    )

    kinds = sorted({k for r in results for k in r.requests_by})
    table = report.table(
        "Requests per learner per committed round, by operation and key kind",
        ["request", *(_config(r) for r in results)],
    )
    for k in kinds:
        table.add(k, *(f"{r.requests_by.get(k, 0):.2f}" for r in results))
    table.add("total", *(f"{r.requests:.1f}" for r in results))

    table = phase_table(
        report,
        results,
        [_config(r) for r in results],
        "commit latency (Applied.lag_s)",
        "From this learner's snapshot record (Published) on: until the last contributor's "
        "snapshot record; until the closer's claim; the closer's blob gets/puts, then the "
        "rest until its `rounds/` record is written; until each syncer reads that record; "
        "its params download (non-closers); until the training thread applied the commit.",
    )
    table.add("raw put+get of one fragment", *(h.secs(r.raw) for r in results))

    for r in results:
        report.notes.append(
            f"{_config(r)}: {r.rounds} rounds in {r.seconds:.1f} s "
            f"({r.seconds / r.rounds:.2f} s/round), {r.skipped} due syncs skipped "
            "(fragment still in flight)"
        )
        for error in r.errors:
            report.notes.append(f"ERROR {_config(r)}: {error}")

    for backend in dict.fromkeys(r.backend for r in results):
        mine = [r for r in results if r.backend == backend]
        worst_bytes = max(mine, key=lambda r: r.up_down / (2 * r.fragment_bytes))
        b_ratio = worst_bytes.up_down / (2 * worst_bytes.fragment_bytes)
        best_floor = min(star_floor(r.learners) / 2 for r in mine)
        report.target(
            f"bytes per learner per round vs the lower bound, {backend}",
            f"{b_ratio:.2f}x at worst ({_config(worst_bytes)}); best "
            f"{min(r.up_down / (2 * r.fragment_bytes) for r in mine):.2f}x",
            "<= 1.2x",
            b_ratio <= 1.2,
            (
                "Averaged over learners, a round closed by one learner cannot go below "
                f"(3 - 1/L)/2 x the bound ({best_floor:.2f}x at L={min(r.learners for r in mine)}"
                "): the closer downloads L-1 snapshots and uploads the result, the others "
                "download it. On top: the momentum blob (1/L fragment up per learner) and "
                "momentum downloads by a closer whose cache misses (see the bytes table). A "
                "contributor that does not close moves exactly the bound (1 up, 1 down)"
            ),
        )
        worst_lag = max(mine, key=lambda r: _median(r.lag) / r.raw)
        l_ratio = _median(worst_lag.lag) / worst_lag.raw
        sees = [_median(r.phases.get("syncer: sees the record", [])) for r in mine]
        report.target(
            f"commit latency vs raw put+get of one fragment, {backend}",
            f"{l_ratio:.1f}x at worst ({_config(worst_lag)}: {h.secs(_median(worst_lag.lag))} "
            f"vs {h.secs(worst_lag.raw)}); best "
            f"{min(_median(r.lag) / r.raw for r in mine):.1f}x",
            "<= 2x",
            l_ratio <= 2,
            (
                "See the phase table: the syncer learns of a commit by polling every "
                f"poll_interval={args.poll_interval} s (median wait until it sees the record: "
                f"{h.secs(_median(sees))}), and the closer downloads, combines, encodes and "
                "uploads (params and momentum) one after another"
            ),
        )
    report.data = {"args": vars(args), "configs": rows_json}
    return report


# -- running ---------------------------------------------------------------------------------


def defaults(ctx: h.Context) -> argparse.Namespace:
    """The preset's arguments (``--quick``: one learner count, fewer rounds)."""
    return argparse.Namespace(
        backends=["seaweedfs", "filesystem"],
        learners=ctx.pick([2, 4], [2], [2, 4, 8]),
        fragments=[1, 4],
        params=ctx.pick([10_000_000], [10_000_000], [10_000_000, 100_000_000]),
        rounds=ctx.pick(8, 3, 12),
        warmup=ctx.pick(2, 1, 3),
        sync_every=8,
        poll_interval=0.5,
        step_ms=5.0,
        reps=ctx.pick(5, 3),
        ref_steps=ctx.pick(100, 50),
        max_seconds=ctx.pick(60.0, 20.0, 150.0),
    )


def run(ctx: h.Context) -> h.Report:
    args = ctx.options.get(NAME, {}).get("args") or defaults(ctx)
    results: list[Result] = []
    workdir = ctx.workdir / f"rounds-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    for backend in args.backends:
        opener: Any = seaweedfs_target(workdir) if backend == "seaweedfs" else file_target(workdir)
        with opener as target:
            for params, learners, fragments in itertools.product(
                args.params, args.learners, args.fragments
            ):
                results.append(Run(args, target, learners, fragments, params).execute())

    return build_report(results, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="seaweedfs,filesystem")
    parser.add_argument("--learners", default="2,4", help="comma-separated learner counts")
    parser.add_argument("--fragments", default="1,4", help="comma-separated fragment counts")
    parser.add_argument("--params", default="10M", help="model sizes, e.g. 10M,100M")
    parser.add_argument("--rounds", type=int, default=8, help="committed rounds measured")
    parser.add_argument("--warmup", type=int, default=2, help="training rounds before measuring")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.5, help="Session default: 0.5")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sleep per fake step")
    parser.add_argument("--reps", type=int, default=5, help="raw put+get repetitions")
    parser.add_argument("--ref-steps", type=int, default=100, help="reference training steps")
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="per configuration, then report partial"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON record")
    args = parser.parse_args()
    args.params = [h.count(x) for x in args.params.split(",") if x.strip()]
    args.learners = _ints(args.learners)
    args.fragments = _ints(args.fragments)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"seaweedfs", "filesystem"}
    if unknown:
        parser.error(f"unknown backends: {sorted(unknown)}")
    json_path = args.json
    del args.json
    from bench.__main__ import run_suite

    return run_suite([NAME], options={NAME: {"args": args}}, json_path=json_path)


if __name__ == "__main__":
    sys.exit(main())
