"""Benchmark 4 — training-thread cost: how long ``Session.step()`` holds the training thread,
against a bare training step and against hivemind's blocking averaging round.

Two learner processes (``_twoproc.py``) on the filesystem mailbox:

1. the ~1M-parameter MLP trained for real (forward + backward + SGD, batch 32, CPU) with
   ``DiLoCo()`` defaults (sync_every=100, one fragment): the mean time of a ``step()`` call
   over all calls, against the median bare training step measured in the same process
   before it joined (and the median training step during the run, for the load);
2. a 10M-parameter model, one fragment: per sync, the ``step()`` call that copies the due
   fragment out plus the one that applies the commit, against hivemind's blocking
   ``DecentralizedAverager.step()`` of a 10M-parameter float32 tensor between 2 local
   processes (``hivemind_ref.py``), measured in the same run.

Targets: < 1% of a 1M-parameter CPU step per ``step()`` call on average; per sync at least
10x less blocking than hivemind's averaging round.
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

NAME = "step"


def sync_config(ctx: h.Context, poll_interval: float = 0.5) -> _twoproc.Config:
    """The two-process sync run that benchmarks 4 and 5 share."""
    return _twoproc.Config(
        mode="sync",
        params=10_000_000,
        rounds=ctx.pick(8, 4),
        warmup=2,
        poll_interval=poll_interval,
    )


def run(ctx: h.Context) -> h.Report:
    report = h.Report(
        NAME,
        "4. Training-thread cost: time step() holds the training thread",
        "a bare training step of a 1M-param MLP (batch 32, CPU) and hivemind's blocking "
        "averaging round of 10M float32 parameters between 2 local processes, in this run",
    )
    # 1. The MLP, trained for real.
    train = _twoproc.run(
        ctx, "filesystem", _twoproc.Config(mode="train", steps=ctx.pick(3000, 1000))
    )
    table = report.table(
        "step() on a real training loop: 1M-param MLP, DiLoCo() defaults (sync_every=100, "
        "1 fragment), 2 processes, filesystem mailbox",
        [
            "process",
            "bare step (before joining)",
            "training step (during the run)",
            "step() calls: mean",
            "plain (n, median)",
            "snapshot (n, median)",
            "apply (n, median)",
            "mean step() / training step",
            "skipped syncs",
        ],
        note=(
            "plain: the call neither copied a fragment out nor applied a commit; snapshot: "
            "it copied the due fragment for the communication thread; apply: it applied a "
            "staged commit in place. The overhead is the mean over all calls, against the "
            "faster of the bare step (measured in both processes at once, before joining) "
            "and the training step during the run."
        ),
    )
    overheads = []
    data: dict[str, Any] = {"train": []}
    for learner in train["learners"]:
        calls = learner["calls"]
        bare = h.Stats.of(learner["bare_step_s"]).median
        during = h.Stats.of(learner["train_s"]).median
        by_kind: dict[str, list[float]] = {"plain": [], "snapshot": [], "apply": []}
        for kind, took in calls:
            by_kind[kind].append(took)
        mean = sum(t for _, t in calls) / len(calls)
        ref = min(bare, during)  # the faster of the two: the stricter reference
        overheads.append(mean / ref)
        table.add(
            f"proc-{learner['index']}",
            h.secs(bare),
            h.secs(during),
            h.secs(mean),
            *(
                f"{len(by_kind[k])}, {h.secs(h.Stats.of(by_kind[k]).median)}"
                for k in ("plain", "snapshot", "apply")
            ),
            h.pct(mean, ref),
            learner["skipped_syncs"],
        )
        data["train"].append(
            {
                "bare_step_median_s": bare,
                "train_step_median_s": during,
                "step_mean_s": mean,
                "by_kind_median_s": {k: h.Stats.of(v).median for k, v in by_kind.items()},
                "by_kind_n": {k: len(v) for k, v in by_kind.items()},
                "skipped_syncs": learner["skipped_syncs"],
            }
        )
    worst = max(overheads)
    split = data["train"][overheads.index(worst)]
    med, n = split["by_kind_median_s"], split["by_kind_n"]
    total_n = sum(n.values())
    report.target(
        "mean step() per call vs a 1M-param CPU training step",
        f"{100 * worst:.2f}% (worse process)",
        "< 1%",
        worst < 0.01,
        (
            "Per call, amortized: plain calls "
            f"{h.secs(med['plain'] * n['plain'] / total_n)}, fragment copies "
            f"{h.secs(med['snapshot'] * n['snapshot'] / total_n)} (a copy of the fragment "
            f"into a pooled buffer every sync_every calls, {h.secs(med['snapshot'])} each), "
            "applies "
            f"{h.secs(med['apply'] * n['apply'] / total_n)}"
        ),
    )

    # 2. Per sync, 10M parameters, against hivemind.
    result = _twoproc.run(ctx, "filesystem", sync_config(ctx))
    rounds = _twoproc.sync_rounds(result)
    snap = h.Stats.of(x for r in rounds for x in r["snapshot_s"])
    apply = h.Stats.of(x for r in rounds for x in r["apply_s"])
    per_sync = h.Stats.of(
        s + a for r in rounds for s, a in zip(r["snapshot_s"], r["apply_s"], strict=True)
    )
    plain = h.Stats.of(x for learner in result["learners"] for x in learner["plain_s"])
    try:
        hm: dict[str, Any] | None = hivemind_ref.reference(ctx)
    except Unavailable as exc:
        hm = None
        report.notes.append(f"hivemind reference not measured: {exc}")
    hm_step = h.Stats.of(hm["step_s"]) if hm else h.Stats.of([])
    table = report.table(
        f"Blocking per sync, 10M float32 parameters in one fragment, 2 processes, filesystem "
        f"mailbox ({len(rounds)} rounds x 2 processes)",
        ["what blocks the training thread", "time, median (min–max)", "hivemind / this"],
        note=(
            "hivemind: DecentralizedAverager.step() (matchmaking + all-reduce), blocking, "
            f"hivemind {hm['version'] if hm else '-'}, per process per round."
        ),
    )
    table.add("step() that copies the due fragment out", h.secs_range(snap), "")
    table.add("step() that applies the commit", h.secs_range(apply), "")
    table.add(
        "per sync (the two together)",
        h.secs_range(per_sync),
        h.ratio(hm_step.median, per_sync.median, 1),
    )
    table.add("a plain step() call", h.secs_range(plain), "")
    table.add("hivemind: blocking averaging round", h.secs_range(hm_step), "1.0x")
    if hm:
        factor = hm_step.median / per_sync.median
        report.target(
            "blocking per sync vs hivemind's averaging round (10M params)",
            f"{factor:.1f}x less ({h.secs(per_sync.median)} vs {h.secs(hm_step.median)})",
            ">= 10x less",
            factor >= 10,
            "step() copies the fragment into a pooled buffer (one pass) and rebases in "
            "place (two passes over the fragment); hivemind's step() blocks for matchmaking "
            "and the all-reduce",
        )
    else:
        report.target(
            "blocking per sync vs hivemind's averaging round (10M params)",
            f"{h.secs(per_sync.median)} per sync; hivemind not measured",
            ">= 10x less",
            None,
        )
    data["per_sync"] = {
        "snapshot_s": snap.__dict__,
        "apply_s": apply.__dict__,
        "per_sync_s": per_sync.__dict__,
        "plain_s": plain.__dict__,
        "hivemind_step_s": hm_step.__dict__,
    }
    report.data = data
    return report
