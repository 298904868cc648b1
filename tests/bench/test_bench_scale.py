"""The scale benchmark's code path (``bench/scale.py``: DiLoCo and Moshpit side by side) on
tiny sizes, so that it cannot rot.

N = 2 and 4 learners (threads), a 2K-parameter model, 5 ms steps, two measured rounds, on the
in-process and the filesystem mailbox. Only structural invariants are asserted, never
timings: both algorithms at every N, bytes per round > 0, a DiLoCo closer reads the other N-1
snapshots and a Moshpit group closer exactly M-1 (payloads, counted from the recorded store
calls), every group of a full grid holds its M members and none is missed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import _harness as h
from bench import scale

TINY: dict[str, Any] = {
    "backends": ["memory", "filesystem"],
    "learners": [2, 4],
    "group_sizes": [2, 4],  # M=4 only where N is a power of 4: N=4 (d=1)
    "params": 4_096,  # build_model: 8 x Linear(16, 16), 2,176 parameters
    "rounds": 2,
    "step_ms": 5.0,
    "poll_interval": 0.1,
    "reps": 1,
    "max_seconds": 120.0,  # a bound on a hang; two rounds take well under a second
}


def test_fit_power_recovers_an_exact_power_law() -> None:
    ns = [2.0, 4.0, 8.0, 16.0]
    k, a, r2 = scale.fit_power(ns, [3.0 * n**1.5 for n in ns])
    assert k == pytest.approx(1.5)
    assert a == pytest.approx(3.0)
    assert r2 == pytest.approx(1.0)
    flat, _, _ = scale.fit_power(ns, [5.0] * 4)
    assert flat == pytest.approx(0.0)
    assert math.isnan(scale.fit_power([2.0], [1.0])[0])


def test_full_grids_only() -> None:
    assert [scale.grid_dims(n, 2) for n in (2, 4, 8, 128)] == [1, 2, 3, 7]
    assert [scale.grid_dims(n, 4) for n in (4, 16, 64)] == [1, 2, 3]
    assert scale.grid_dims(8, 4) is None
    assert scale.grid_dims(6, 2) is None


@pytest.mark.timeout(600)  # a bound on a hang, not a speed: loaded CI machines are slow
def test_scale_benchmark_runs_both_algorithms_at_every_n(tmp_path: Path) -> None:
    ctx = h.Context(quick=True, large=False, workdir=tmp_path, options={"scale": TINY})
    report = scale.run(ctx)
    assert report.error is None
    rendered = report.render()
    assert "DiLoCo vs Moshpit per round" in rendered
    assert "Growth law" in rendered

    configs = report.data["configs"]
    seen = sorted((c["backend"], c["learners"], c["variant"]) for c in configs)
    assert seen == sorted(
        (backend, n, variant)
        for backend in ("memory", "filesystem")
        for n, variant in [
            (2, "diloco"),
            (2, "moshpit M=2"),
            (4, "diloco"),
            (4, "moshpit M=2"),
            (4, "moshpit M=4"),
        ]
    )
    for c in configs:
        where = (c["backend"], c["learners"], c["variant"])
        n = c["learners"]
        assert not c["errors"], where
        assert c["failures"] == 0, where
        assert c["rounds"] >= 1, where
        assert c["bytes_per_learner_round"] > 0, where
        assert c["requests_per_learner_round"] > 0, where
        assert c["closer_down_bytes"], where
        assert all(b > 0 for b in c["closer_down_bytes"]), where
        assert c["lag_s"], where
        if c["algorithm"] == "diloco":
            # One closing per round; its closer reads every other learner's snapshot.
            assert c["closer_snapshot_payloads"] == [n - 1] * len(c["closer_down_bytes"]), where
        else:
            m = int(c["variant"].rpartition("M=")[2])
            assert c["expected_snapshot_payloads"] == m - 1
            # A full grid: every group of every round of the window closed, with its M
            # members, its closer reading exactly the M-1 other members' payloads.
            assert len(c["closer_down_bytes"]) == c["rounds"] * n // m, where
            assert c["group_members"] == [m] * len(c["closer_down_bytes"]), where
            assert c["closer_snapshot_payloads"] == [m - 1] * len(c["group_members"]), where
            assert c["missed_groups"] == 0, where
            assert c["missed_groups_total"] == 0, where
            assert c["short_groups_total"] == 0, where
            assert c["wait_timeouts"] == 0, where

    # Every N has a side-by-side row per Moshpit variant; fits exist per algorithm.
    side = report.tables[0]
    assert sorted((row[0], row[1], row[2]) for row in side.rows) == sorted(
        (backend, n, grid)
        for backend in ("memory", "filesystem")
        for n, grid in [("2", "M=2, d=1"), ("4", "M=2, d=2"), ("4", "M=4, d=1")]
    )
    assert {
        f"{backend} {variant}"
        for backend in ("memory", "filesystem")
        for variant in ("diloco", "moshpit M=2", "moshpit M=4")
    } == set(report.data["fits"])
    json.dumps(report.to_json())
