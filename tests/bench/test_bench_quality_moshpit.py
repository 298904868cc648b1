"""The Moshpit arms of the quality benchmark (``bench/quality_moshpit.py``, run by
``bench/quality.py`` with ``moshpit`` among its arms) on tiny sizes.

One run of the ``--tiny`` configuration: 4 learner processes per arm (DiLoCo, and Moshpit
on a full 2x2 grid), ``gm.align`` in a separate process, ``ddp`` and ``solo-average`` over
the same 4 shards. Only the structure is asserted, never the losses against each other
(that is what the benchmark reports): every arm finished with a finite loss, the Moshpit
mailbox holds the group commits the grid predicts, no group was missed or short, and
``align`` loaded the average of the newest group round.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch

import gradientmail as gm
from bench import _harness as h
from bench import _quality_worker as worker
from bench import quality
from bench import quality_moshpit as qm


def test_each_shard_is_cut_into_contiguous_parts_one_per_learner() -> None:
    shards = [torch.arange(10, dtype=torch.uint8) + 10 * j for j in range(4)]
    parts, what = qm.split_shards(shards, 8)
    assert len(parts) == 8
    for j in range(4):
        assert torch.equal(torch.cat([parts[2 * j], parts[2 * j + 1]]), shards[j])
        assert [w["shards"] for w in what[2 * j : 2 * j + 2]] == [[j], [j]]
    assert [w["bytes"] for w in what] == [5] * 8
    same, _ = qm.split_shards(shards, 4)
    assert all(torch.equal(a, b) for a, b in zip(same, shards, strict=True))
    two, _ = qm.split_shards(shards, 2)  # fewer learners: shards joined round-robin
    assert torch.equal(two[0], torch.cat([shards[0], shards[2]]))
    with pytest.raises(ValueError, match="multiple"):
        qm.split_shards(shards, 6)


def test_the_grids_expected_groups() -> None:
    full = qm.Grid(2, 3)  # 8 learners fill it: every group of every round has 2
    for t in (1, 2, 3, 4):
        assert sorted(full.expected(8, t).values()) == [2, 2, 2, 2]
    partial = qm.Grid(4, 2)  # 8 of 16 cells: groups of 4, then of 2
    assert partial.expected(8, 1) == {"x-000": 4, "x-001": 4}
    assert partial.expected(8, 2) == {"000-x": 2, "001-x": 2, "002-x": 2, "003-x": 2}
    assert partial.expected(8, 3) == partial.expected(8, 1)
    assert partial.describe(8) == "M=4 d=2 (8 of 16 cells)"
    assert full.describe(8) == "M=2 d=3 (full grid)"


def test_the_worker_builds_moshpit_from_the_arms_settings() -> None:
    algorithm = worker.make_algorithm(gm, qm.Grid(4, 2).spec(), 25, 1)
    assert algorithm == gm.Moshpit(sync_every=25, group_size=4, grid_dims=2)
    assert algorithm.settings()["name"] == "moshpit"
    assert worker.make_algorithm(gm, None, 25, 1) == gm.DiLoCo(sync_every=25, fragments=1)
    with pytest.raises(ValueError, match="compression"):
        worker.make_algorithm(gm, {"name": "moshpit", "compression": {"name": "cast"}}, 5, 1)


@pytest.mark.timeout(900)  # a bound on a hang, not a speed: loaded CI machines are slow
def test_tiny_run_moshpit_beside_diloco(tmp_path: Path) -> None:
    learners = 4
    ctx = h.Context(
        quick=False,
        large=False,
        workdir=tmp_path,
        options={
            quality.NAME: {
                "arms": ["moshpit"],
                qm.OPTIONS: {
                    "tiny": True,
                    "learners": learners,
                    "grids": [[2, 2]],
                    "poll_interval": 0.1,
                    "round_timeout": 300.0,
                },
            }
        },
    )
    report = quality.run(ctx)
    assert report.error is None
    rows = {row["key"]: row for row in report.data[qm.OPTIONS]["arms"]}
    assert set(rows) == {"diloco-4", "moshpit-M2", "ddp-4", "solo-average-4"}
    for row in rows.values():
        assert row["error"] is None, row
        assert math.isfinite(row["final_loss"]), row
        assert row["curve"], row
        assert all(math.isfinite(y) for _, y in row["curve"]), row

    steps, h_every = qm.TINY.steps, qm.TINY.sync_every[0]
    for key in ("diloco-4", "moshpit-M2"):
        data = rows[key]["data"]
        assert len(data["learners"]) == learners
        assert len(rows[key]["learner_losses"]) == learners
        assert all(math.isfinite(x) for x in rows[key]["learner_losses"])
        assert data["bytes_per_round"]["total"] > 0
        assert data["rounds_per_learner"] == steps // h_every
        assert data["wait_timeouts"] == 0
    assert rows["diloco-4"]["data"]["rounds_committed"] == steps // h_every
    assert len(rows["solo-average-4"]["learner_losses"]) == learners

    moshpit = rows["moshpit-M2"]["data"]
    for learner in moshpit["learners"]:
        assert learner["algorithm"] == {
            "name": "moshpit",
            "sync_every": h_every,
            "group_size": 2,
            "grid_dims": 2,
        }
        assert learner["counters"]["missed_groups"] == 0
    # A full 2x2 grid: every group round has two groups of two, all of them committed.
    assert moshpit["group_rounds"] == steps // h_every
    assert moshpit["group_commits"] == 2 * (steps // h_every)
    assert moshpit["group_sizes"] == {"2": 2 * (steps // h_every)}
    assert moshpit["missed_groups"] == 0
    assert moshpit["short_groups"] == []
    assert moshpit["excluded"] == 0
    evaluation = moshpit["evaluation"]
    assert evaluation["aligned_rounds"] == {"0": steps // h_every}
    assert moshpit["align_matches_groups"] is True
    assert any("group round" in line for line in moshpit["align_log"])

    assert [t.name.split(" ")[0] for t in report.targets] == ["moshpit-M2"]
    assert all(t.met in (True, False) for t in report.targets)
    rendered = report.render()
    assert "vs diloco-4" in rendered
    assert "Moshpit group rounds" in rendered
    assert json.loads(json.dumps(report.to_json(), default=str))["data"][qm.OPTIONS]["arms"]
