"""The utilization benchmark's code path on tiny sizes, so that it cannot rot.

Two learner processes, a 20K-parameter model, 5 ms steps, two sync periods, every policy,
on the filesystem mailbox (SeaweedFS excepted: its start and stop cost more than the rest).
Only the structure is asserted, never the numbers: every policy row present, fractions
within [0, 1], the record serializable.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import _harness as h
from bench import utilization

TINY: dict[str, Any] = {
    "params": 20_000,
    "step_ms": 5.0,
    "sync_every": 5,
    "learners": 2,
    "periods": 2,
    "backends": ["filesystem"],
    "poll_interval": 0.1,
    "timeout": 60.0,
}


@pytest.mark.timeout(600)  # a bound on a hang, not a speed: loaded CI machines are slow
def test_utilization_benchmark_reports_every_policy(tmp_path: Path) -> None:
    ctx = h.Context(quick=True, large=False, workdir=tmp_path, options={"utilization": TINY})
    report = utilization.run(ctx)
    assert report.error is None
    rendered = report.render()
    assert "step() wait fraction" in rendered

    summary = report.data["summary"]
    assert set(summary) == {"filesystem"}
    row = summary["filesystem"]
    assert set(utilization.POLICIES) <= set(row)
    assert row["bare"]["wall_s"]["n"] == TINY["learners"]
    for policy in utilization.POLICIES:
        r = row[policy]
        for key in ("step_fraction", "waited_fraction", "step_outside_waits_fraction"):
            st = r[key]
            assert st["n"] == TINY["learners"], (policy, key)
            assert 0.0 <= st["min"] <= st["median"] <= st["max"] <= 1.0, (policy, key, st)
        assert 0.0 <= r["contributing"] <= 1.0
        assert r["sync_points"] == TINY["learners"] * TINY["periods"]
        assert 0 <= r["contributed"] <= r["sync_points"]
        assert r["wall_over_bare"]["median"] > 0
        if policy != "free_running":  # it may see no commit of its own within the loop
            assert r["round_trip_s"]["n"] > 0
            # A commit of its own came back: a training round (one fragment: round >= 1).
            assert r["rounds_final"] >= 1
        learners = report.data["learners"]["filesystem"][policy]
        assert [x["index"] for x in learners] == list(range(TINY["learners"]))
        for learner in learners:
            assert math.isfinite(learner["wall_s"])
            assert learner["wall_s"] > 0
            assert 0.0 <= learner["in_step_s"] <= learner["wall_s"]

    # Every policy has a row in both tables; the targets are stated.
    for table in report.tables:
        labels = {row[1] for row in table.rows}
        for policy in utilization.POLICIES:
            assert any(label.startswith(policy) for label in labels), (table.title, policy)
    assert report.targets

    # The record is JSON, as the suite writes it.
    json.dumps(report.to_json())
