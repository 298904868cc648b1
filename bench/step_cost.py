"""Benchmark 4 — training-thread cost: how long ``Session.step()`` holds the training thread,
against a bare training step and against hivemind's blocking averaging round.

Two learner processes (``_twoproc.py``) on the filesystem mailbox: (1) the ~1M-parameter MLP
trained for real with ``DiLoCo()`` defaults: the mean ``step()`` call against the faster of
the bare training step (measured before joining) and the training step during the run;
(2) 10M parameters in one fragment: per sync, the call that copies the due fragment out plus
the one that applies the commit, against hivemind's blocking ``DecentralizedAverager.step()``
of 10M float32 between 2 local processes (``hivemind_ref.py``), in the same run.

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

NAME = "step"
KINDS = ("plain", "snapshot", "apply")


def sync_config(ctx: h.Context, poll_interval: float = 0.5) -> _twoproc.Config:
    """The two-process sync run that benchmarks 4 and 5 share."""
    return _twoproc.Config(mode="sync", rounds=ctx.pick(8, 4), poll_interval=poll_interval)


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
    header = [
        "process", "bare step (before joining)", "training step (during the run)",
        "step() calls: mean", *(f"{k} (n, median)" for k in KINDS),
        "mean step() / training step", "skipped syncs",
    ]  # fmt: skip
    table = report.table(
        "step() on a real training loop: 1M-param MLP, DiLoCo() defaults (sync_every=100, "
        "1 fragment), 2 processes, filesystem mailbox",
        header,
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
        bare = h.median(learner["bare_step_s"])
        during = h.median(learner["train_s"])
        by_kind = {k: [took for kind, took in calls if kind == k] for k in KINDS}
        mean = sum(t for _, t in calls) / len(calls)
        ref = min(bare, during)  # the faster of the two: the stricter reference
        overheads.append(mean / ref)
        table.add(f"proc-{learner['index']}", h.secs(bare), h.secs(during), h.secs(mean),
                  *(f"{len(by_kind[k])}, {h.secs(h.median(by_kind[k]))}" for k in KINDS),
                  h.pct(mean, ref), learner["skipped_syncs"])  # fmt: skip
        data["train"].append(
            {
                "bare_step_median_s": bare,
                "train_step_median_s": during,
                "step_mean_s": mean,
                "by_kind_median_s": {k: h.median(v) for k, v in by_kind.items()},
                "by_kind_n": {k: len(v) for k, v in by_kind.items()},
                "skipped_syncs": learner["skipped_syncs"],
            }
        )
    worst = max(overheads)
    split = data["train"][overheads.index(worst)]
    med, n = split["by_kind_median_s"], split["by_kind_n"]
    share = {k: h.secs(med[k] * n[k] / sum(n.values())) for k in KINDS}
    report.target(
        "mean step() per call vs a 1M-param CPU training step",
        f"{100 * worst:.2f}% (worse process)",
        "< 1%",
        worst < 0.01,
        f"Per call, amortized: plain calls {share['plain']}, fragment copies "
        f"{share['snapshot']} (a copy of the fragment into a pooled buffer every sync_every "
        f"calls, {h.secs(med['snapshot'])} each), applies {share['apply']}",
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
    hm = hivemind_ref.reference_or_note(ctx, report)
    hm_step = h.Stats.of(hm["step_s"] if hm else [])
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
    ratio = h.ratio(hm_step.median, per_sync.median, 1)
    table.add("per sync (the two together)", h.secs_range(per_sync), ratio)
    table.add("a plain step() call", h.secs_range(plain), "")
    table.add("hivemind: blocking averaging round", h.secs_range(hm_step), "1.0x")
    factor = hm_step.median / per_sync.median if hm else 0.0
    report.target(
        "blocking per sync vs hivemind's averaging round (10M params)",
        f"{factor:.1f}x less ({h.secs(per_sync.median)} vs {h.secs(hm_step.median)})"
        if hm
        else f"{h.secs(per_sync.median)} per sync; hivemind not measured",
        ">= 10x less",
        factor >= 10 if hm else None,
        "step() copies the fragment into a pooled buffer (one pass) and rebases in place "
        "(two passes over the fragment); hivemind's step() blocks for matchmaking and the "
        "all-reduce"
        if hm
        else "",
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
