"""The quality benchmark's code paths on tiny sizes, so that it cannot rot.

Every arm of ``python -m bench quality --quick`` runs (SeaweedFS excepted: its start and
stop cost more than the rest): learner processes through ``gm.Session`` on a file mailbox,
``gm.align`` in a separate process, the in-process arms. The numbers themselves are never
asserted, only the structure: every arm present, finite losses, counters reported, the
record serializable, the plot written where matplotlib is installed; and the one promise
that is a fact, not a number: every exact (overlap 0) arm's aligned model equals its
in-process reference bitwise, the bfloat16 model's too (float32 outer state, loads rounded
by ``Tensor.to``), and so do learners of 2 DDP ranks (their own small run).
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
from bench import _quality_report as report_module

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


@pytest.mark.timeout(900)  # a bound on a hang, not a speed: loaded CI machines are slow
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
    assert {"diloco-bfloat16", "reference-bfloat16"} <= arms
    assert "diloco-ddp" not in arms  # on request only
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
        assert row["data"]["align_equals_newest"] is True, row["key"]
        default_overlap = report.data["overlap_setting"]["default"]
        if row["overlap"] == 0 or (row["overlap"] is None and default_overlap == "0"):
            # exact DiLoCo: the reference of the same H, F and dtype, bit for bit
            assert row["data"]["bitwise_reference"] is True, row["key"]
    bf16 = {row["arm"]: row for row in rows if row["dtype"] == "bfloat16"}
    assert set(bf16) == {"diloco-bfloat16", "reference-bfloat16"}
    assert bf16["diloco-bfloat16"]["overlap"] == 0
    assert "reference-bfloat16" in rendered
    assert "bfloat16" in bf16["diloco-bfloat16"]["setting"]

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


def test_compression_arms_selection_and_table() -> None:
    """Pure: which compressed arms a selection runs, and their table from learners' counters."""
    assert quality.compression_arms({}, None, 25, 1) == []  # not in the default run
    assert quality.compression_arms({}, {"diloco"}, 25, 1) == []
    named = quality.compression_arms({}, {"sparseloco-2%", "diloco-bf16"}, 25, 1)
    assert [a.arm for a in named] == ["sparseloco-2%", "diloco-bf16"]  # priority order
    assert named[0].key == "sparseloco-2%-H25-F1"
    assert named[0].gradientmail
    every = quality.compression_arms({"compression_arms": True}, {"diloco"}, 25, 4)
    assert [a.arm for a in every] == list(quality.COMPRESSION_ARMS)
    assert all(a.compressed and a.fragments == 4 for a in every)
    tuned = quality.compression_arms({"sparseloco": {"outer_lr": 0.7}}, {"compression"}, 25, 1)
    assert tuned[0].algorithm == {"name": "sparseloco", "settings": {"outer_lr": 0.7}}
    assert "outer_lr=0.7" in tuned[0].setting

    def learners(up: int, down: int, settings: dict[str, object]) -> list[dict[str, object]]:
        counters = {"bytes_up_total": up, "bytes_down_total": down, "applied": 10}
        return [{"counters": counters, "algorithm": settings}] * _lm.LEARNERS

    dense = quality.Arm("diloco-H25-F1", "diloco", "main", 25, 1, backend="file")
    dense.final_loss = 2.0
    dense.data = {"learners": learners(1000, 3000, {"name": "diloco"}), "rounds_committed": 10}
    sparse = tuned[0]
    sparse.final_loss = 2.1
    topk = {"name": "topk", "density": 0.02, "bits": 2, "chunk": 4096}
    settings = {"name": "sparseloco", "outer_lr": 0.7, "error_decay": 1, "compression": topk}
    sparse.data = {
        "learners": learners(100, 300, settings),
        "rounds_committed": 10,
    }
    report = h.Report("quality", "t", "-")
    report_module.compression_table(report, [dense, sparse], TINY)
    rows = {row["arm"]: row for row in report.data["compression"]}
    assert rows["diloco"]["bytes_per_round"]["total"] == 400
    assert rows["sparseloco-2%"]["bytes_per_round"] == {
        "applied": 10,
        "computed": 0,
        "up": 10,
        "down": 30,
        "total": 40,
    }
    assert rows["sparseloco-2%"]["dense_over_compressed_total"] == 10
    assert math.isclose(rows["sparseloco-2%"]["vs_dense"], 0.05)
    assert rows["sparseloco-2%"]["dense_over_compressed_contribution"] > 1
    rendered = report.render()
    assert "SparseLoCo: TopK 2%, 2 bits, outer_lr 0.7, error_decay 1" in rendered
    assert "+5.00%" in rendered


def test_compression_arms_build_their_algorithms() -> None:
    """Every compressed arm's spec makes the algorithm its name says (what learners run)."""
    import gradientmail as gm
    from bench._quality_worker import make_algorithm

    assert make_algorithm(gm, None, 25, 4) == gm.DiLoCo(sync_every=25, fragments=4)
    built = {
        name: make_algorithm(gm, spec, 25, 1) for name, spec in quality.COMPRESSION_ARMS.items()
    }
    assert built["sparseloco-2%"] == gm.SparseLoCo(sync_every=25, fragments=1)
    assert built["sparseloco-1%"].compression == gm.TopK(density=0.01, bits=2)
    assert built["diloco-topk-2%-8b"].compression == gm.TopK(density=0.02, bits=8)
    assert built["diloco-bf16"].compression == gm.Cast("bfloat16")
    assert built["diloco-int8"].compression == gm.Quantize(bits=8)
    words = {name: report_module.describe_algorithm(a.settings()) for name, a in built.items()}
    assert words["diloco-topk-5%-2b"] == "DiLoCo: TopK 5%, 2 bits"
    assert words["sparseloco-2%"].startswith("SparseLoCo: TopK 2%, 2 bits, outer_lr 1,")
    tuned = make_algorithm(gm, {"name": "sparseloco", "settings": {"error_decay": 0.9}}, 25, 1)
    assert tuned.error_decay == 0.9


@pytest.mark.timeout(600)  # a bound on a hang, not a speed
def test_ddp_learners_equal_their_reference_bitwise(tmp_path: Path) -> None:
    """``--arms diloco-ddp,reference-ddp``: 4 learners of 2 DDP ranks (gloo) end with the
    parameters of the reference that takes each learner step as the two ranks' half-batch
    gradients averaged, bit for bit; every learner's ranks alike; rank 0 alone moves bytes;
    a learner counts its ranks' samples (as many as a learner of one rank)."""
    ctx = h.Context(
        quick=True,
        large=False,
        workdir=tmp_path,
        options={
            "quality": {
                "sizes": TINY.to_json(),
                "s3": False,
                "arms": ["diloco-ddp", "reference-ddp"],
            },
            "json_path": str(tmp_path / "quality-ddp.json"),
        },
    )
    report = quality.run(ctx)
    assert report.error is None
    rows = {row["arm"]: row for row in report.data["arms"]}
    assert set(rows) == {"diloco-ddp", "reference-ddp"}
    ddp = rows["diloco-ddp"]
    assert ddp["error"] is None, ddp
    assert rows["reference-ddp"]["error"] is None
    assert ddp["ranks"] == rows["reference-ddp"]["ranks"] == 2
    assert ddp["data"]["bitwise_reference"] is True
    assert ddp["data"]["ranks_identical"] is True
    assert ddp["data"]["align_equals_newest"] is True
    trained = _lm.LEARNERS * TINY.batch * TINY.steps
    assert ddp["data"]["samples_trained"] == ddp["data"]["samples_in_final"] == trained
    per_rank = {row["rank"]: row for row in report.data["ranks"]}
    assert per_rank[0]["bytes_up"] > 0
    assert per_rank[0]["bytes_down"] > 0
    assert per_rank[1]["bytes_up"] == per_rank[1]["bytes_down"] == 0
    assert "mailbox traffic per rank per round" in report.render()


def test_variant_arms_selection() -> None:
    """Pure: the bfloat16 arm runs by default, the DDP arm only when named; both exact."""
    default = quality.variant_arms(None, 25, 1)
    assert [(a.key, a.dtype, a.ranks) for a in default] == [
        ("diloco-bfloat16-H25-F1", "bfloat16", 1)
    ]
    assert default[0].reference_key == "reference-bfloat16-H25-F1"
    assert quality.variant_arms({"diloco"}, 25, 4) == []
    (ddp,) = quality.variant_arms({"diloco-ddp"}, 25, 4)
    assert (ddp.ranks, ddp.dtype, ddp.overlap, ddp.fragments) == (2, "float32", 0, 4)
    assert ddp.reference_key == "reference-ddp-H25-F4"
    assert "2 ranks" in ddp.setting
    plain = quality.Arm("diloco-H25-F4", "diloco", "main", 25, 4)
    fast = quality.Arm("diloco-fast", "diloco-fast", "fast", 25, 1)
    assert (plain.reference_key, fast.reference_key) == (
        "reference-H25-F4",
        "reference-fast-H25-F1",
    )
