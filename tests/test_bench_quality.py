"""The quality benchmark's code paths on tiny sizes, so that it cannot rot.

Every arm of ``python -m bench quality --quick`` runs (SeaweedFS excepted: its start and
stop cost more than the rest): learner processes through ``gm.Session`` on a file mailbox,
``gm.align`` in a separate process, the in-process arms. The numbers themselves are never
asserted, only the structure: every arm present, finite losses, counters reported, the
record serializable, the plot written where matplotlib is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench import _harness as h
from bench import _lm, quality

TINY = _lm.Sizes(
    model=_lm.ModelSize(d_model=16, layers=1, heads=2),
    fast_model=_lm.ModelSize(d_model=8, layers=1, heads=2),
    batch=2,
    steps=8,
    fast_steps=8,
    context=16,
    checkpoints=2,
    eval_windows=8,
    sync_every=(4,),
    fragments=(2,),
    max_stdlib_bytes=100_000,
)


@pytest.mark.timeout(240)
def test_quality_benchmark_runs_every_arm(tmp_path: Path) -> None:
    ctx = h.Context(
        quick=True,
        large=False,
        workdir=tmp_path,
        options={
            "quality": {"sizes": TINY.to_json(), "s3": False},
            "json_path": str(tmp_path / "quality-test.json"),
        },
    )
    report = quality.run(ctx)
    assert report.error is None
    rendered = report.render()
    assert "Validation loss per arm" in rendered

    rows = report.data["arms"]
    arms = {row["arm"] for row in rows}
    assert {"ddp", "reference", "diloco", "diloco-fast", "solo-average"} <= arms
    for row in rows:
        assert row["error"] is None, row
        assert math.isfinite(row["final_loss"]), row
        assert row["curve"], row
        assert all(math.isfinite(y) for _, y in row["curve"])
    for row in rows:
        if not row["arm"].startswith("diloco"):
            continue
        assert len(row["learners"]) == _lm.LEARNERS
        for learner in row["learners"]:
            counters = learner["counters"]
            assert counters["bytes_up_total"] > 0
            assert counters["bytes_down_total"] > 0
            assert learner["steps"] > 0
            assert learner["gradientmail_file"]
        assert row["data"]["rounds_committed"] == len(row["evaluation"]["rounds"])
        assert row["data"]["sync_points"] > 0
        assert row["evaluation"]["final_loss"] == row["final_loss"]

    assert report.targets, "the benchmark states its targets"
    assert report.data["library"]["commit"]
    assert report.data["corpus"]["shards"][0]["bytes"] > 0
    # The record is JSON, as the suite writes it.
    text = json.dumps(report.to_json(), default=str)
    assert json.loads(text)["data"]["arms"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert Path(report.data["png"]).exists()
    else:
        assert report.data["png"].startswith("not written")
