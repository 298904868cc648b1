"""Benchmark 5 — time to a synchronized model: two learner processes, 10M float32
parameters in one fragment, from both handing their fragment over (the due ``step()`` call),
and from both snapshots in the store (``Published``), to both having applied the commit, on
the filesystem mailbox and on SeaweedFS (started fresh on loopback).

Reference: hivemind's blocking averaging round of 10M float32 between 2 local processes
(from both having called ``DecentralizedAverager.step()`` to both having returned), measured
in the same run (``hivemind_ref.py``). Target: at most hivemind's time on the filesystem.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench import _twoproc, hivemind_ref
from bench.step_cost import sync_config

NAME = "sync"
FAST = 0.05  # the extra row's poll_interval: what polling costs
# (key in sync_rounds, column) in the table's order; a ratio to hivemind after the first two.
PHASES = [
    ("from_due_s", "both handed over -> both applied"),
    ("from_published_s", "both published -> both applied"),
    ("publish_s", "phases: hand-over -> both published"),
    ("close_s", "-> record written (close)"),
    ("apply_after_commit_s", "-> both applied (poll, download, apply)"),
]


def run(ctx: h.Context) -> h.Report:
    report = h.Report(
        NAME,
        "5. Time to a synchronized model: 2 processes, 10M parameters",
        "hivemind's blocking averaging round of 10M float32 parameters between 2 local "
        "processes, measured in this run",
    )
    hm = hivemind_ref.reference_or_note(ctx, report)
    hm_round = h.Stats.of(hm["round_s"] if hm else [])
    header = ["system", "rounds"]
    for i, (_, column) in enumerate(PHASES):
        header += [column, "vs hivemind"] if i < 2 else [column]
    table = report.table(
        "Time to a synchronized model, 10M float32 parameters, 2 processes "
        f"(poll_interval {sync_config(ctx).poll_interval} s)",
        header,
        note=(
            "Handed over: the due step() call began (the training thread gives its fragment "
            "to the communication thread). Published: the snapshot and its record are in the "
            "store. Record written: the closer's `rounds/` record is in the store (its "
            "Committed event). Applied: the step() call that applied the commit began. "
            "hivemind: from "
            "both processes having called DecentralizedAverager.step() to both having "
            "returned (matchmaking + all-reduce), min_matchmaking_time 0.5 s. The row with "
            f"poll_interval {FAST} s (not the default) shows what polling costs: the closer "
            "looks for the other snapshot, and the syncer for the record, every poll_interval."
        ),
    )
    data: dict[str, Any] = {}
    configs = [("filesystem", 0.5), ("seaweedfs", 0.5)]
    configs += [] if ctx.quick else [("filesystem", FAST)]
    for backend, poll in configs:
        result = _twoproc.run(ctx, backend, sync_config(ctx, poll))
        rounds = _twoproc.sync_rounds(result)
        stats = {key: h.Stats.of(r[key] for r in rounds) for key, _ in PHASES}
        label = backend if poll == 0.5 else f"{backend}, poll_interval {poll} s"
        cells: list[object] = [f"gradientmail, {label}", len(rounds)]
        for i, (key, _) in enumerate(PHASES):
            cells.append(h.secs_range(stats[key]))
            if i < 2:
                cells.append(h.ratio(stats[key].median, hm_round.median))
        table.add(*cells)
        failures = [f for learner in result["learners"] for f in learner["failures"]]
        if failures:
            report.notes.append(f"{backend}: background failures: {failures[:3]}")
        data[label] = {key: st.__dict__ for key, st in stats.items()} | {"rounds": rounds}
        if (backend, poll) == ("filesystem", 0.5):
            due, pub = stats["from_due_s"].median, stats["from_published_s"].median
            report.target(
                "time to a synchronized model, filesystem mailbox, vs hivemind",
                f"{h.secs(due)} from hand-over ({h.secs(pub)} from both published) vs "
                f"hivemind {h.secs(hm_round.median)}"
                if hm
                else f"{h.secs(due)} from hand-over; hivemind not measured",
                "<= hivemind's round",
                due <= hm_round.median if hm else None,
            )
    hm_cells = [len(hm["round_s"]) if hm else 0, h.secs_range(hm_round), "1.00x" if hm else "-"]
    table.add("hivemind (blocking all-reduce)", *hm_cells, *[""] * 5)
    if hm:
        data["hivemind"] = hm
        if not hm["peers_agree"]:
            report.notes.append("hivemind: the two peers' tensors differed after a round")
    report.data = data
    return report
