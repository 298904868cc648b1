"""Benchmark 5 — time to a synchronized model: two learner processes, 10M float32
parameters in one fragment, from the moment both hand their fragment over (the due
``step()`` call) — and from the moment both snapshots are in the store (``Published``) — to
the moment both have applied the commit, on the filesystem mailbox and on SeaweedFS
(started fresh on loopback).

Reference: hivemind's blocking averaging round of a 10M-parameter float32 tensor between 2
local processes (``DecentralizedAverager.step()``, from both having called it to both having
returned), measured in the same run (``hivemind_ref.py``).

Target: at most hivemind's time on the filesystem mailbox; SeaweedFS reported as measured.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench import _twoproc, hivemind_ref
from bench.hivemind_setup import Unavailable
from bench.step_cost import sync_config

NAME = "sync"


def run(ctx: h.Context) -> h.Report:
    report = h.Report(
        NAME,
        "5. Time to a synchronized model: 2 processes, 10M parameters",
        "hivemind's blocking averaging round of 10M float32 parameters between 2 local "
        "processes, measured in this run",
    )
    try:
        hm: dict[str, Any] | None = hivemind_ref.reference(ctx)
    except Unavailable as exc:
        hm = None
        report.notes.append(f"hivemind reference not measured: {exc}")
    hm_round = h.Stats.of(hm["round_s"]) if hm else h.Stats.of([])
    fast = 0.05
    table = report.table(
        "Time to a synchronized model, 10M float32 parameters, 2 processes "
        f"(poll_interval {sync_config(ctx).poll_interval} s)",
        [
            "system",
            "rounds",
            "both handed over -> both applied",
            "vs hivemind",
            "both published -> both applied",
            "vs hivemind",
            "phases: hand-over -> both published",
            "-> record written (close)",
            "-> both applied (poll, download, apply)",
        ],
        note=(
            "Handed over: the due step() call began (the training thread gives its fragment "
            "to the communication thread). Published: the snapshot and its record are in the "
            "store. Record written: the closer's `rounds/` record is in the store (its "
            "Committed event). Applied: the step() call that applied the commit began. "
            "hivemind: from "
            "both processes having called DecentralizedAverager.step() to both having "
            "returned (matchmaking + all-reduce), min_matchmaking_time 0.5 s. The row with "
            f"poll_interval {fast} s (not the default) shows what polling costs: the closer "
            "looks for the other snapshot, and the syncer for the record, every poll_interval."
        ),
    )
    data: dict[str, Any] = {}
    configs = [("filesystem", 0.5), ("seaweedfs", 0.5)]
    if not ctx.quick:
        configs.append(("filesystem", fast))
    for backend, poll in configs:
        result = _twoproc.run(ctx, backend, sync_config(ctx, poll))
        rounds = _twoproc.sync_rounds(result)
        due = h.Stats.of(r["from_due_s"] for r in rounds)
        pub = h.Stats.of(r["from_published_s"] for r in rounds)
        publish = h.Stats.of(r["publish_s"] for r in rounds)
        close = h.Stats.of(r["close_s"] for r in rounds)
        after = h.Stats.of(r["apply_after_commit_s"] for r in rounds)
        label = f"gradientmail, {backend}"
        if poll != 0.5:
            label += f", poll_interval {poll} s"
        table.add(
            label,
            len(rounds),
            h.secs_range(due),
            h.ratio(due.median, hm_round.median),
            h.secs_range(pub),
            h.ratio(pub.median, hm_round.median),
            h.secs_range(publish),
            h.secs_range(close),
            h.secs_range(after),
        )
        failures = [f for learner in result["learners"] for f in learner["failures"]]
        if failures:
            report.notes.append(f"{backend}: background failures: {failures[:3]}")
        data[label.removeprefix("gradientmail, ")] = {
            "from_due_s": due.__dict__,
            "from_published_s": pub.__dict__,
            "publish_s": publish.__dict__,
            "close_s": close.__dict__,
            "apply_after_commit_s": after.__dict__,
            "rounds": rounds,
        }
        if backend == "filesystem" and poll == 0.5:
            if hm:
                report.target(
                    "time to a synchronized model, filesystem mailbox, vs hivemind",
                    f"{h.secs(due.median)} from hand-over ({h.secs(pub.median)} from both "
                    f"published) vs hivemind {h.secs(hm_round.median)}",
                    "<= hivemind's round",
                    due.median <= hm_round.median,
                )
            else:
                report.target(
                    "time to a synchronized model, filesystem mailbox, vs hivemind",
                    f"{h.secs(due.median)} from hand-over; hivemind not measured",
                    "<= hivemind's round",
                    None,
                )
    table.add(
        "hivemind (blocking all-reduce)",
        len(hm["round_s"]) if hm else 0,
        h.secs_range(hm_round),
        "1.00x" if hm else "-",
        "",
        "",
        "",
        "",
        "",
    )
    if hm:
        data["hivemind"] = hm
        if not hm["peers_agree"]:
            report.notes.append("hivemind: the two peers' tensors differed after a round")
    report.data = data
    return report
