"""The compression table of ``bench/rounds.py`` (``--compression``): parsing its settings, the
analytic bytes per element, the commit-upload split and the report, on made-up results (no
learners, no timing)."""

from __future__ import annotations

import argparse
import json

import pytest

import gradientmail as gm
from bench import _harness as h
from bench import rounds
from bench._fleet import Result


def test_settings_parse_to_the_algorithms_they_name() -> None:
    dense = rounds.parse_setting("dense")
    assert dense.compression is None
    assert not dense.sparse
    assert dense.algorithm(8, 1) == gm.DiLoCo(sync_every=8, fragments=1)

    topk = rounds.parse_setting("topk:1%:4")
    assert topk.compression == gm.TopK(density=0.01, bits=4)
    assert topk.label == "DiLoCo TopK 1% 4b"
    assert topk.algorithm(8, 2) == gm.DiLoCo(
        sync_every=8, fragments=2, compression=topk.compression
    )

    assert rounds.parse_setting("topk:0.05:8:1024").compression == gm.TopK(0.05, 8, 1024)
    assert rounds.parse_setting("cast").compression == gm.Cast("bfloat16")
    assert rounds.parse_setting("cast:float16").compression == gm.Cast("float16")
    assert rounds.parse_setting("quantize:8").compression == gm.Quantize(bits=8)

    sparse = rounds.parse_setting("sparseloco")
    assert sparse.sparse
    assert sparse.compression == gm.TopK(density=0.02, bits=2)
    assert isinstance(sparse.algorithm(8, 1), gm.SparseLoCo)
    assert rounds.parse_setting("sparseloco:0.01:2").compression == gm.TopK(0.01, 2)


@pytest.mark.parametrize("spec", ["topk", "topk:0.01", "topk:0.01:3", "zip:1", "dense:1", "cast:x"])
def test_bad_settings_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="compression setting"):
        rounds.parse_setting(spec)


def test_the_list_puts_the_dense_reference_first_once() -> None:
    every = rounds.parse_settings("all")
    assert [s.spec for s in every] == list(rounds.DEFAULT_SETTINGS)
    assert len(every) == 16
    # @K: SparseLoCo storing its parameters every K rounds, another setting of its own.
    stored = rounds.parse_setting("sparseloco:1%:2@4")
    assert stored.dense_every == 4
    assert stored.label == "SparseLoCo TopK 1% 2b dense every 4"
    assert stored.algorithm(8, 1) == gm.SparseLoCo(
        sync_every=8, compression=gm.TopK(0.01, 2), dense_every=4
    )
    with pytest.raises(ValueError, match="SparseLoCo's"):
        rounds.parse_setting("topk:0.02:2@4")
    picked = rounds.parse_settings("sparseloco, topk:0.02:2, topk:2%:2")
    assert [s.label for s in picked] == [
        "DiLoCo dense float32",
        "SparseLoCo TopK 2% 2b (default)",
        "DiLoCo TopK 2% 2b",
    ]


def test_analytic_bytes_per_element_sum_the_compressors_sizes() -> None:
    numels = [4096 * 10, 100]
    topk = rounds.parse_setting("topk:0.02:2")
    expected = (gm.TopK(0.02, 2).encoded_bytes(40960) + gm.TopK(0.02, 2).encoded_bytes(100)) / (
        40960 + 100
    )
    assert topk.bytes_per_element(numels) == pytest.approx(expected)
    assert rounds.parse_setting("dense").bytes_per_element(numels) == 4.0
    assert rounds.parse_setting("cast").bytes_per_element(numels) == 2.0


def test_commit_upload_and_records_are_split_from_the_purposes() -> None:
    purposes = {
        "put snapshot [up]": 10.0,
        "get snapshot [down]": 20.0,
        "put params [up]": 100.0,
        "put momentum [up]": 50.0,
        "get params (sync) [down]": 70.0,
        "get momentum [down]": 5.0,
        "put rounds (records) [up]": 1.0,
        "get rounds (records) [down]": 2.0,
    }
    assert rounds.commit_upload(purposes) == 150.0
    assert rounds.records(purposes) == 3.0


def _result(up: float, down: float, purposes: dict[str, float]) -> Result:
    return Result(
        backend="filesystem",
        learners=3,
        fragments=1,
        params=1000,
        fragment_bytes=4000.0,
        rounds=9,
        seconds=1.0,
        up_down=up + down,
        requests=1.0,
        lag=[],
        raw=float("nan"),
        steps={},
        purposes=purposes,
        requests_by={},
        phases={},
        partial=False,
        skipped=0,
        errors=[],
        up=up,
        down=down,
        applied=1.0,
    )


def test_the_report_shows_every_setting_against_the_dense_reference() -> None:
    settings = rounds.parse_settings("topk:0.02:2")
    dense = _result(4000.0, 4000.0, {"put params [up]": 1000.0, "put snapshot [up]": 4000.0})
    topk = _result(1000.0, 1000.0, {"put params [up]": 1000.0, "put snapshot [up]": 80.0})
    runs = [
        rounds.CompressionRun(s, r, [1000]) for s, r in zip(settings, [dense, topk], strict=True)
    ]
    stats = h.Stats(0.001, 0.001, 0.001, 1)
    codecs = {
        (1000, 3, 1): rounds.CodecTimes(
            1000,
            h.Stats(0.01, 0.01, 0.01, 1),
            {repr(settings[1].compression): stats},
            {"dense": stats, repr(settings[1].compression): stats},
        )
    }
    args = argparse.Namespace(sync_every=8, step_ms=5.0, max_seconds=45.0, compression="x")
    report = rounds.build_compression_report(runs, codecs, args)
    text = report.render()
    assert "DiLoCo TopK 2% 2b" in text
    assert "4.00x" in text
    assert "7.00x" in text  # without the commit upload: 7000 / 1000
    row = report.data["settings"][1]
    assert row["dense_over_this"] == 4.0
    assert row["without_commit_upload"] == 1000.0
    assert row["bytes_per_element_measured"] == pytest.approx(0.08)
    json.dumps(report.to_json())
