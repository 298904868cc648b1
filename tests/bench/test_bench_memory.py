"""The host-memory benchmark's code path in quick mode, so that it cannot rot.

``python -m bench memory --quick`` with fewer sync periods: a 2M-parameter model, 1 and 4
fragments, 2 learner processes on the filesystem mailbox, and the training-alone reference.
Only the structure is asserted, never the numbers: a row per configuration, positive peaks,
the ledger's breakdown keys present (whether or not the purposes read zero), the record
serializable.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from bench import _harness as h
from bench import _memory_report, memory


@pytest.mark.timeout(900)  # a bound on a hang, not a speed: loaded CI machines are slow
def test_memory_benchmark_reports_every_configuration(tmp_path: Path) -> None:
    # A hang fails within minutes, with every learner's stacks on stderr. Four sync periods
    # (quick: 10) are enough to fill every column: growth compares period 2 with the last.
    options = {"memory": {"stall_s": 150, "periods": 4, "growth_from": 2}}
    ctx = h.Context(quick=True, large=False, workdir=tmp_path, options=options)
    config = memory.config_for(ctx)
    report = memory.run(ctx)
    assert report.error is None
    rendered = report.render()
    assert "Peak RSS per learner process" in rendered
    assert "memory_usage()" in rendered

    expected = {
        (params, backend, fragments, n)
        for params in config.models
        for backend in config.backends
        for fragments in config.fragments
        for n in config.learners
    }
    assert len(expected) >= 2
    rows = report.data["configs"]
    assert {(r["params"], r["backend"], r["fragments"], r["n"]) for r in rows} == expected
    for params in config.models:
        alone = report.data["alone"][str(params)]
        assert alone["peak"] >= alone["rss_base"] > alone["rss_before"] > 0
        assert alone["gradientmail_imported"] is False
    for row in rows:
        if "skipped" in row:  # a machine without the memory for it says so
            assert row["skipped"].startswith("skipped: needs")
            continue
        assert "error" not in row, row
        learners = row["learners"]
        assert [x["index"] for x in learners] == list(range(row["n"]))
        assert 0 <= row["closer_index"] < row["n"]
        assert row["rounds_closed"] > 0
        assert row["model_bytes"] > 0
        assert row["fragment_bytes"] == row["model_bytes"] / row["fragments"]
        for x in learners:
            assert x["peak"] >= x["rss_base"] > 0
            assert x["peak"] >= x["vm_hwm"] > 0
            assert x["samples"] > 0
            assert len(x["periods"]) == config.periods
            assert all(p["peak"] > 0 and p["rss"] > 0 for p in x["periods"])
            usage = x["usage_after_close"]
            if usage is not None:  # None on a checkout without gm.memory_usage
                assert set(_memory_report.PURPOSES) <= set(usage["peak"])
                assert set(_memory_report.PURPOSES) <= set(usage["live"])
                assert usage["live_total"] == sum(usage["live"].values()), usage
                peaks = usage["peak"].values()
                assert max(peaks) <= usage["peak_total"] <= sum(peaks), usage
                assert usage["live_total"] <= usage["peak_total"], usage

    # Every measured configuration has its rows in the tables; the targets are stated.
    peaks, ledger, growth = report.tables[1], report.tables[2], report.tables[3]
    measured = [r for r in rows if "learners" in r]
    assert len(peaks.rows) == len(rows)
    assert len(ledger.rows) == 2 * len(measured)  # a learner and the closer
    assert len(growth.rows) == len(measured)
    for table in (peaks, ledger):
        assert all(len(r) == len(table.header) for r in table.rows if "skipped" not in r[-1])
    names = [t.name for t in report.targets]
    assert len(names) == 3
    for name, start in zip(
        names,
        (
            _memory_report.OVERHEAD_TARGET,
            _memory_report.CLOSER_TARGET,
            _memory_report.GROWTH_TARGET,
        ),
        strict=True,
    ):
        assert name.startswith(start)

    json.dumps(report.to_json())
