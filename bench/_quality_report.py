"""The quality benchmark's report (``quality.py``): its tables, targets and loss-curve plot,
from the arms a run measured (``quality.Bench``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import _harness as h
from bench import _lm
from gradientmail.demo import lm

if TYPE_CHECKING:
    from bench.quality import Arm, Bench

SPARK = "▁▂▃▄▅▆▇█"
QUALITY_NOTE = (
    "`vs reference`: against DiLoCo in one process with the same H and F; `vs "
    "reference-late`: against the same applied N steps late (N = the arm's median commit "
    "lag). GradientMail arms: `gm.align` in a separate process after the learners finished. "
    "The reference contributes each fragment's steps since its last sync point at the end "
    "(what `close()` does). Wall: training time (in-process arms ran {parallel} at a time, "
    "evaluation excluded; diloco arms: the slowest learner's training and close)."
)
SYNC_NOTE = (
    "Sync points: due steps a learner reached (each should commit one round). Time in "
    "step(): the slowest learner's total time inside `session.step()`; `step() waited`: "
    "`Counters.waited_s`. Commit lag: inner steps from a learner's snapshot to the step() "
    "call that applied its round (0 = exact DiLoCo). Samples in final model: the fewest "
    "samples any fragment's commits account for, against the samples trained. Bitwise: the "
    "aligned model against the final parameters of the `reference` of the same H, F, model "
    "dtype and ranks per learner (`reference-bfloat16`: float32 outer state, loads rounded "
    "as a learner rounds them; `reference-ddp`: each learner step two half-batch gradients "
    "averaged as DDP averages them, since a float32 sum over two halves is not the "
    "gradient of the whole batch bit for bit) (max |difference| otherwise), and against "
    "`reference-late`'s where there is one."
)
RANKS_NOTE = (
    "Per process (rank) of a learner of several ranks, averaged over the learners: its own "
    "`session.counters()` bytes and requests to the mailbox over the rounds its learner "
    "applied (rank 0's `applied`). Rank 0 alone talks to the mailbox; the other ranks move "
    "0 bytes there and receive each applied fragment from rank 0 by a gloo broadcast "
    "(`session/_ranks.py`; not counted here). Ranks identical: every learner's ranks ended "
    "with the same parameters (sha256 of their bytes). vs 1-rank reference: the aligned "
    "model against `reference` of one rank per learner (whole-batch gradients), where it ran."
)
COMPRESSION_NOTE = (
    "Bytes: each learner's `session.counters()` bytes_up and bytes_down (every key kind) "
    "over the rounds it applied (`Counters.applied`; SparseLoCo learners' `computed` commits "
    "in brackets), averaged over the learners. `vs dense diloco`: against the `diloco` arm "
    "of the same H and F in this run. Contribution: what one learner's contribution to a "
    "round encodes to (`encoded_bytes` of every parameter tensor, float32 when dense; over "
    "F): the closer's commit upload and the commit downloads are not compressed, and "
    "dominate the totals of a small model."
)


def describe_algorithm(settings: Mapping[str, Any] | None) -> str:
    """An ``Algorithm.settings()`` (what a learner reports) in words."""
    if not settings:
        return "-"
    c = settings.get("compression")
    if not c:
        words = "dense (parameters)"
    elif c["name"] == "topk":
        words = f"TopK {100 * c['density']:g}%, {c['bits']} bits"
    elif c["name"] == "cast":
        words = f"Cast {c['dtype']}"
    elif c["name"] == "quantize":
        words = f"Quantize {c['bits']} bits"
    else:
        words = str(c)
    if settings.get("name") == "sparseloco":
        return (
            f"SparseLoCo: {words}, outer_lr {settings['outer_lr']:g}, "
            f"error_decay {settings['error_decay']:g}"
        )
    return f"DiLoCo: {words}" if c else words


def per_round(learners: Sequence[Mapping[str, Any]], rounds_committed: int) -> dict[str, Any]:
    """Bytes per learner per round: each learner's ``bytes_up`` and ``bytes_down`` (summed
    over kinds) over the rounds it applied (``Counters.applied``; the rounds committed where
    the counter is missing or zero), averaged over the learners."""
    ups, downs, applied, computed = [], [], [], []
    for r in learners:
        c = r["counters"]
        n = c.get("applied") or rounds_committed
        if not n:
            continue
        applied.append(n)
        computed.append(c.get("computed") or 0)
        ups.append(c.get("bytes_up_total", math.nan) / n)
        downs.append(c.get("bytes_down_total", math.nan) / n)
    up, down = h.mean(ups), h.mean(downs)
    return {
        "applied": h.mean(applied),
        "computed": h.mean(computed),
        "up": up,
        "down": down,
        "total": up + down,
    }


def effective_overlap(arm: Arm, default: Any) -> Any:
    """The overlap an arm ran with: its own, else the library's default."""
    return default if arm.overlap is None else arm.overlap


def sparkline(values: Sequence[float], low: float, high: float) -> str:
    if not values or math.isnan(low) or high <= low:
        return ""
    top = len(SPARK) - 1
    return "".join(
        SPARK[max(0, min(top, int((v - low) / (high - low) * top + 0.5)))] for v in values
    )


def _gap(value: float, reference: float) -> float:
    return value / reference - 1


Column = tuple[str, Callable[[Any], object]]


def _or_na(value: Any, show: Callable[[Any], str]) -> str:
    return "n/a" if value is None else show(value)


def _bitwise(d: Mapping[str, Any]) -> str:
    bits, late = d.get("bitwise_reference"), d.get("bitwise_reference_late")
    vs = "-" if bits is None else "yes" if bits else f"no ({d['max_abs_diff_vs_reference']:.2g})"
    if late is None:
        return vs
    return vs + (
        "; = reference-late: yes"
        if late
        else f"; vs reference-late {d['max_abs_diff_vs_reference_late']:.2g}"
    )


SYNC_COLUMNS: list[Column] = [
    ("arm", lambda a: a.arm + (" (tiny)" if a.family == "fast" else "")),
    ("setting", lambda a: a.setting),
    (
        "rounds committed / sync points",
        lambda a: (
            f"{a.data['rounds_committed']} / {a.data['sync_points']}"
            + (f" (counter {n})" if (n := a.data.get("sync_points_counter")) else "")
        ),
    ),
    ("contributors / round", lambda a: h.num(a.data.get("contributors_per_round"), "{:.2f}")),
    (
        "sync points skipped (all learners)",
        lambda a: _or_na(
            a.data.get("skipped"), lambda n: f"{n} of {a.data['skipped_total_points']}"
        ),
    ),
    ("time in step()", lambda a: h.secs(a.data["step_s_max"])),
    ("step() waited (counter)", lambda a: _or_na(a.data.get("waited_s"), h.secs)),
    (
        "commit lag: steps (median, max)",
        lambda a: (
            f"{h.num(a.data.get('lag_steps_median'), '{:.0f}')}, "
            f"{h.num(a.data.get('lag_steps_max'))}"
        ),
    ),
    ("commit lag: s", lambda a: _or_na(a.data.get("lag_s_median"), h.secs)),
    ("up / learner", lambda a: h.size(a.data["bytes_up"])),
    ("down / learner", lambda a: h.size(a.data["bytes_down"])),
    (
        "samples in final model",
        lambda a: _or_na(
            a.data.get("samples_in_final"), lambda n: f"{n} / {a.data['samples_trained']}"
        ),
    ),
    ("= reference bitwise", lambda a: _bitwise(a.data)),
]


def build(
    report: h.Report,
    bench: Bench,
    corpus: lm.Corpus,
    library: dict[str, Any],
    default_overlap: Any,
    params: tuple[int, int],
    seconds: float,
) -> None:
    """Every table, target and note of a run (not the Moshpit arms'), and its JSON."""
    arms, sizes = bench.arms, bench.sizes
    main_params, fast_params = params

    def get(key: str | None) -> Arm | None:
        arm = arms.get(key or "")
        return arm if arm is not None and not arm.error else None

    data_table = report.table(
        f"Data: the stdlib's .py sources ({corpus.files} files, Python {corpus.python}), "
        f"byte tokens, context {sizes.context}",
        ["learner", "shard (non-IID)", "bytes", "files", "top-level names (largest first)"],
        note=(
            f"Validation: every {lm.HOLDOUT}th block of {lm.BLOCK} bytes across all files "
            f"({corpus.val_bytes / 1e6:.2f} MB, "
            f"{100 * corpus.val_bytes / (corpus.val_bytes + corpus.train_bytes):.1f}%), "
            f"{sizes.eval_windows} fixed windows evaluated. Model: {main_params / 1e6:.2f}M "
            f"params (d_model {sizes.model.d_model}, {sizes.model.layers} layers, "
            f"{sizes.model.heads} heads), tiny {fast_params / 1e3:.0f}K (d_model "
            f"{sizes.fast_model.d_model}, {sizes.fast_model.layers} layer); AdamW lr "
            f"{sizes.lr:g}, warm-up 5% then cosine to 10%; B = {sizes.batch} per learner, "
            f"T/M = {sizes.steps} local steps ({sizes.fast_steps} tiny), T = "
            f"{_lm.LEARNERS * sizes.batch * sizes.steps} samples; {sizes.threads} torch "
            f"thread(s) per process; seed {sizes.seed}."
        ),
    )
    for src in corpus.sources:
        names = src["top_level"]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        data_table.add(
            _lm.learner_id(src["learner"]), src["what"], h.size(src["bytes"]), src["files"], shown
        )

    ddp = {fam: get("ddp" + ("-fast" if fam == "fast" else "")) for fam in ("main", "fast")}

    def reference_of(arm: Arm) -> Arm | None:
        return get(arm.reference_key)

    def late_of(arm: Arm) -> Arm | None:
        key = arm.key if arm.arm != "diloco-s3" else _file_twin(arms, arm)
        return get(f"reference-late-{key}") if key else None

    quality = report.table(
        "Validation loss per arm (nats per byte; lower is better)",
        [
            "arm",
            "model",
            "setting",
            "final loss",
            "ratio to ddp",
            "vs reference",
            "vs reference-late",
            "curve",
            "wall (training)",
        ],
        note=QUALITY_NOTE.format(parallel=bench.parallel),
    )
    order = ["ddp", "reference", "reference-bfloat16", "reference-ddp", "diloco"]
    order += ["diloco-bfloat16", "diloco-ddp", "diloco-s3", "reference-late", "solo-average"]
    ordered = sorted(
        arms.values(),
        key=lambda a: (
            a.family == "fast",
            order.index(a.arm)
            if a.arm in order
            else order.index("diloco-s3") + 0.5
            if a.compressed
            else order.index("diloco"),
            a.sync_every or 0,
            a.fragments or 0,
            a.overlap if a.overlap is not None else -1,
        ),
    )
    lows: dict[str, float] = {}
    highs: dict[str, float] = {}
    for a in ordered:  # one scale per model, the first checkpoint left out (it dwarfs the rest)
        for _, y in a.curve[1:] or a.curve:
            lows[a.family] = min(lows.get(a.family, math.inf), y)
            highs[a.family] = max(highs.get(a.family, -math.inf), y)
    rows = []
    for a in ordered:
        ref = reference_of(a) if a.arm != "reference" else None
        late = late_of(a) if a.arm.startswith("diloco") else None
        d = ddp[a.family]
        rows.append(
            h.fields(a, "key arm family setting sync_every fragments overlap late backend dtype")
            | h.fields(a, "ranks")
            | ({"algorithm": a.algorithm} if a.compressed else {})
            | {
                "final_loss": a.final_loss,
                "ratio_to_ddp": a.final_loss / d.final_loss if d else None,
                "vs_reference": _gap(a.final_loss, ref.final_loss) if ref else None,
                "vs_reference_late": _gap(a.final_loss, late.final_loss) if late else None,
            }
            | h.fields(a, "curve wall_s error")
            | {
                "data": {k: v for k, v in a.data.items() if k not in ("learners", "evaluation")},
                "learners": a.data.get("learners"),
                "evaluation": a.data.get("evaluation"),
            }
        )
        if a.error:
            quality.add(a.arm, a.family, a.setting, f"ERROR: {a.error}", *[""] * 5)
            continue
        quality.add(
            a.arm + (" (exact)" if a.overlap == 0 else ""),
            (
                f"tiny {fast_params / 1e3:.0f}K"
                if a.family == "fast"
                else f"{main_params / 1e6:.2f}M"
            )
            + ("" if a.dtype == "float32" else f" {a.dtype}"),
            a.setting,
            f"{a.final_loss:.4f}",
            h.ratio(a.final_loss, d.final_loss, 3) if d else "-",
            h.change(a.final_loss, ref.final_loss) if ref and a is not ref else "-",
            h.change(a.final_loss, late.final_loss) if late else "-",
            sparkline(
                [y for _, y in a.curve], lows.get(a.family, math.nan), highs.get(a.family, math.nan)
            ),
            h.secs(a.wall_s),
        )

    h.spec_table(
        report,
        "GradientMail arms: rounds, waiting, lag, traffic (per learner unless said)",
        SYNC_COLUMNS,
        [a for a in ordered if a.gradientmail and not a.error],
        SYNC_NOTE,
    )

    checkpoints = sorted({x for a in ordered for x, _ in a.curve if a.family == "main"})
    if checkpoints:
        curve = report.table(
            f"Loss curve: validation loss against samples seen (model of {main_params / 1e6:.2f}M)",
            ["arm", "setting", *[f"{x / 1000:.1f}K" for x in checkpoints]],
            note=(
                "GradientMail arms: the model of each fragment's newest commit at or before "
                "the checkpoint (samples committed)."
            ),
        )
        for a in ordered:
            if a.family == "main" and not a.error:
                ys = dict(a.curve)
                cells = [f"{ys[x]:.3f}" if x in ys else "" for x in checkpoints]
                curve.add(a.arm, a.setting, *cells)

    rank_table(report, ordered)
    compression_table(report, ordered, sizes)
    targets(report, ordered, default_overlap, reference_of, late_of, ddp)
    report.data.update(
        {
            "sizes": sizes.to_json(),
            "corpus": corpus.describe(),
            "params": {"main": main_params, "fast": fast_params},
            "library": library,
            "overlap_setting": {"present": True, "default": repr(default_overlap)},
            "arms": rows,
            "seconds": round(seconds, 1),
        }
    )
    report.notes.append(
        f"gradientmail measured: {library.get('gradientmail_file')} at "
        f"{library.get('describe')}"
        + (" (library files modified)" if library.get("library_modified") else "")
        + f"; `overlap` setting: default {default_overlap!r}"
    )
    for a in ordered:
        if a.data.get("failures"):
            report.notes.append(
                f"{a.label()}: {len(a.data['failures'])} failure events, "
                f"first: {a.data['failures'][0]}"
            )
        if a.data.get("curve_error"):
            report.notes.append(f"{a.label()}: no loss curve ({a.data['curve_error']})")
        if a.data.get("align_equals_newest") is False:
            report.notes.append(
                f"{a.label()}: gm.align loaded something other than the newest commits"
            )


def rank_table(report: h.Report, ordered: Sequence[Arm]) -> None:
    """Learners of several ranks: each rank's mailbox traffic per round (``rank_traffic``)."""
    multi = [a for a in ordered if a.ranks > 1 and not a.error and a.data.get("ranks")]
    if not multi:
        return
    table = report.table(
        "Learners of several ranks: mailbox traffic per rank per round",
        [
            "arm",
            "setting",
            "rank",
            "rounds applied / learner",
            "up / round",
            "down / round",
            "requests / round",
            "ranks identical",
            "max abs diff vs 1-rank reference",
        ],
        note=RANKS_NOTE,
    )
    rows = []
    for a in multi:
        for rank in range(a.ranks):
            mine = [r for r in a.data["ranks"] if r["rank"] == rank]
            rounds = h.mean([r["rounds_applied"] for r in mine])
            per = {
                k: h.mean([r[k] / r["rounds_applied"] for r in mine if r["rounds_applied"]])
                for k in ("bytes_up", "bytes_down", "requests")
            }
            table.add(
                a.arm,
                a.setting,
                rank,
                h.num(rounds, "{:.1f}"),
                h.size(per["bytes_up"]),
                h.size(per["bytes_down"]),
                h.num(per["requests"], "{:.1f}"),
                "yes" if a.data.get("ranks_identical") else "NO",
                _or_na(a.data.get("max_abs_diff_vs_reference_one_rank"), "{:.2g}".format),
            )
            rows.append({"key": a.key, "rank": rank, "rounds_applied": rounds} | per)
    report.data["ranks"] = rows


def contribution_bytes(settings: Mapping[str, Any] | None, numels: Sequence[int]) -> float:
    """One learner's contribution to one round, as encoded: every parameter tensor's
    ``Compression.encoded_bytes`` (dense: float32), over the fragments (exact for F = 1)."""
    if not settings or not numels:
        return math.nan
    c = settings.get("compression")
    if c:
        from gradientmail.algorithms.compression import compression_from_settings

        codec = compression_from_settings(c)
        total = sum(codec.encoded_bytes(n) for n in numels)
    else:
        total = 4 * sum(numels)
    return total / int(settings.get("fragments") or 1)


def _div(value: float, by: float) -> float | None:
    if math.isnan(value) or math.isnan(by) or by == 0:
        return None
    return value / by


def compression_table(
    report: h.Report, ordered: Sequence[Arm], sizes: _lm.Sizes | None = None
) -> None:
    """Compressed arms against dense DiLoCo of the same H and F, same run: loss and bytes
    (the encoded contribution from the main model's parameter sizes, with ``sizes``)."""
    compressed = [a for a in ordered if a.compressed]
    if not compressed:
        return
    numels: list[int] = []
    if sizes is not None:
        model = lm.build_model(sizes.model, sizes.context, sizes.seed)
        numels = [t.numel() for t in model.parameters()]

    def dense_of(arm: Arm) -> Arm | None:
        return next(
            (
                b
                for b in ordered
                if b.arm == "diloco"
                and b.overlap is None
                and b.mixing is None
                and (b.sync_every, b.fragments) == (arm.sync_every, arm.fragments)
                and not b.error
            ),
            None,
        )

    table = report.table(
        "Compressed contributions against dense DiLoCo (same H, F, learners, data, run)",
        [
            "arm",
            "setting",
            "algorithm",
            "final loss",
            "vs dense diloco",
            "rounds applied / learner",
            "up / learner / round",
            "down / learner / round",
            "up+down / learner / round",
            "dense / compressed: up",
            "dense / compressed: up+down",
            "contribution (encoded)",
            "dense / compressed: contribution",
        ],
        note=COMPRESSION_NOTE,
    )
    rows: list[dict[str, Any]] = []
    bases: list[Arm] = []
    for a in compressed:
        base = dense_of(a)
        if base is not None and base not in bases:
            bases.append(base)
    for a in [*bases, *compressed]:
        base = a if not a.compressed else dense_of(a)
        if a.error:
            table.add(a.arm, a.setting, "", f"ERROR: {a.error}", *[""] * 9)
            rows.append({"key": a.key, "arm": a.arm, "error": a.error})
            continue
        learners = a.data.get("learners") or []
        settings = learners[0].get("algorithm") if learners else a.algorithm
        mine = per_round(learners, a.data.get("rounds_committed", 0))
        base_learners = (base.data.get("learners") or []) if base else []
        ref = per_round(base_learners, base.data["rounds_committed"]) if base else None
        sent = contribution_bytes(settings, numels)
        sent_dense = (
            contribution_bytes(base_learners[0].get("algorithm"), numels)
            if base_learners
            else math.nan
        )
        applied = h.num(mine["applied"], "{:.1f}") + (
            f" ({h.num(mine['computed'], '{:.1f}')} computed)" if mine["computed"] else ""
        )
        table.add(
            a.arm,
            a.setting,
            describe_algorithm(settings),
            f"{a.final_loss:.4f}",
            (
                f"{h.ratio(a.final_loss, base.final_loss, 4)} "
                f"({h.change(a.final_loss, base.final_loss)})"
                if base
                else "no dense diloco arm"
            ),
            applied,
            h.size(mine["up"]),
            h.size(mine["down"]),
            h.size(mine["total"]),
            h.ratio(ref["up"], mine["up"], 1) if ref else "-",
            h.ratio(ref["total"], mine["total"], 1) if ref else "-",
            h.size(sent),
            h.ratio(sent_dense, sent, 1),
        )
        rows.append(
            {
                "key": a.key,
                "arm": a.arm,
                "algorithm": settings,
                "final_loss": a.final_loss,
                "dense": base.key if base else None,
                "vs_dense": _gap(a.final_loss, base.final_loss) if base else None,
                "bytes_per_round": mine,
                "dense_over_compressed_up": _div(ref["up"], mine["up"]) if ref else None,
                "dense_over_compressed_total": (_div(ref["total"], mine["total"]) if ref else None),
                "contribution_bytes": sent,
                "dense_over_compressed_contribution": _div(sent_dense, sent),
            }
        )
    report.data["compression"] = rows


def _file_twin(arms: Mapping[str, Arm], arm: Arm) -> str | None:
    """The file-mailbox diloco arm of the same setting as ``arm``."""
    for other in arms.values():
        if (
            other.arm == "diloco"
            and other.overlap is None
            and (other.sync_every, other.fragments) == (arm.sync_every, arm.fragments)
        ):
            return other.key
    return None


def targets(
    report: h.Report,
    ordered: Sequence[Arm],
    default_overlap: Any,
    reference_of: Any,
    late_of: Any,
    ddp: Mapping[str, Arm | None],
) -> None:
    gm_arms = [a for a in ordered if a.gradientmail and not a.error]
    for a in ordered:
        if a.gradientmail and a.error:
            report.target(f"{a.label()} ran", "failed", "runs", False, a.error)
    # Compressed arms are not the reference's algorithm: their table compares them with
    # dense DiLoCo; only the rounds target below applies to them.
    dense = [a for a in gm_arms if not a.compressed]
    exact = [a for a in dense if effective_overlap(a, default_overlap) == 0]
    for a in exact:  # without overlap: every diloco arm equals reference
        ref = reference_of(a)
        if ref is None:
            continue
        gap = _gap(a.final_loss, ref.final_loss)
        report.target(
            f"{a.label()} = reference (no overlap)",
            f"{100 * gap:+.2f}%" + (", bitwise" if a.data.get("bitwise_reference") else ""),
            "within ±0.5%",
            abs(gap) <= 0.005,
            "see rounds, skips and lag in the table above" if abs(gap) > 0.005 else "",
        )
    for a in [a for a in dense if a not in exact]:
        late = late_of(a)
        ref = reference_of(a)
        if late is None:
            lag = a.data.get("lag_steps_median")
            report.target(
                f"{a.label()} = reference-late",
                "not run",
                "within ±0.5%",
                None,
                f"median lag {h.num(lag)} steps: no reference-late to compare with",
            )
            continue
        gap = _gap(a.final_loss, late.final_loss)
        price = (
            f"; price of overlap vs reference {h.change(late.final_loss, ref.final_loss)}"
            if ref
            else ""
        )
        if a.arm == "diloco-s3":
            price += (
                "; N from the file arm (this arm's median lag "
                f"{h.num(a.data.get('lag_steps_median'))} steps)"
            )
        report.target(
            f"{a.label()} = reference-late (N={late.late})",
            f"{100 * gap:+.2f}%",
            "within ±0.5%",
            abs(gap) <= 0.005,
            f"skipped {a.data.get('skipped') or 0} sync points{price}",
        )
    # solo-average at least 5% worse than reference (the main one).
    solo = next((a for a in ordered if a.arm == "solo-average" and not a.error), None)
    main_ref = next(
        (
            a
            for a in ordered
            if a.arm == "reference" and a.family == "main" and a.fragments == 1 and not a.error
        ),
        None,
    )
    if solo and main_ref:
        gap = _gap(solo.final_loss, main_ref.final_loss)
        report.target(
            f"solo-average worse than reference {main_ref.setting}",
            f"{100 * gap:+.2f}%",
            ">= +5%",
            gap >= 0.05,
            ""
            if gap >= 0.05
            else "the shards are too alike or the run too short to tell syncing from not",
        )
    # Rounds committed against sync points reached.
    for a in gm_arms:
        d = a.data
        points = d.get("sync_points_counter") or d["sync_points"]
        share = d["rounds_committed"] / points if points else math.nan
        report.target(
            f"{a.label()}: rounds committed / sync points",
            f"{d['rounds_committed']} / {points} ({100 * share:.0f}%)",
            ">= 95%",
            share >= 0.95,
            "" if share >= 0.95 else f"{d.get('skipped') or 0} sync points skipped across learners",
        )
    # Streaming: fragments 4 within 1% of fragments 1.
    plain = [a for a in gm_arms if a.arm == "diloco" and a.overlap is None]
    for a in plain:
        one = next((b for b in plain if b.fragments == 1 and b.sync_every == a.sync_every), None)
        if a.fragments == 1 or one is None:
            continue
        gap = _gap(a.final_loss, one.final_loss)
        report.target(
            f"diloco H={a.sync_every}: fragments {a.fragments} vs fragments 1",
            f"{100 * gap:+.2f}%",
            "within ±1%",
            abs(gap) <= 0.01,
            "" if abs(gap) <= 0.01 else _streaming_why(a),
        )
    # The algorithm's own gap at this scale (reported, not a target).
    for a in ordered:
        base = ddp.get(a.family)
        if a.arm == "reference" and base and not a.error:
            report.notes.append(
                f"reference {a.setting}{' (tiny)' if a.family == 'fast' else ''} against ddp: "
                f"{h.change(a.final_loss, base.final_loss)} (the algorithm's own gap at this scale)"
            )


def _streaming_why(a: Arm) -> str:
    d = a.data
    if d.get("samples_in_final") is not None and d["samples_in_final"] < d["samples_trained"]:
        lost = 1 - d["samples_in_final"] / d["samples_trained"]
        return (
            f"the final model misses up to {100 * lost:.0f}% of the samples trained "
            "(tails not contributed)"
        )
    return "see the loss curve"


# -- the plot --------------------------------------------------------------------------------


def plot_path(ctx: h.Context) -> Path:
    given = ctx.options.get("json_path")
    if given:
        path = Path(given)
        stem = path.stem if path.stem.startswith("quality") else f"{path.stem}-quality"
        return path.with_name(stem + ".png")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return h.ROOT / "bench" / "results" / f"quality-{stamp}.png"


COLOURS = {
    "ddp": "black",
    "solo-average": "tab:gray",
    "reference": "tab:blue",
    "diloco": "tab:orange",
    "diloco-fast": "tab:orange",
    "diloco-s3": "tab:purple",
    "reference-late": "tab:green",
}


def write_plot(bench: Bench, path: Path, main_params: int, fast_params: int) -> str:
    """The loss curves as a PNG, one panel per model and H (ddp and solo-average, no H, in
    every panel of their model; colour: the arm; line: the fragments); without matplotlib,
    say why instead."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        h.progress(f"no plot: {exc} (pip install matplotlib)")
        return f"not written: {exc}"
    arms = [a for a in bench.arms.values() if a.curve and not a.error]
    panels = sorted(
        {(a.family, a.sync_every) for a in arms if a.sync_every is not None},
        key=lambda p: (p[0] == "fast", p[1] or 0),
    )
    if not panels:
        return "not written: no curves"
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    rank = list(COLOURS)
    for ax, (family, h_every) in zip(axes[0], panels, strict=True):
        shown = [a for a in arms if a.family == family and a.sync_every in (None, h_every)]
        tops = []
        for a in sorted(shown, key=lambda a: (rank.index(a.arm) if a.arm in rank else 9, a.key)):
            ys = [y for _, y in a.curve]
            tops += ys[1:] or ys
            # exact DiLoCo red; compressed arms: the colour cycle, dotted
            colour = COLOURS.get(a.arm, "tab:brown") if not a.compressed else None
            ax.plot(
                [x / 1000 for x, _ in a.curve],
                ys,
                color="tab:red" if a.overlap == 0 else colour,
                linestyle=":" if a.compressed else "--" if (a.fragments or 1) > 1 else "-",
                marker="o",
                markersize=3,
                label=a.label(),
                alpha=0.85,
            )
        if tops:  # the first checkpoint (an H=100 run's initial model) would dwarf the rest
            low, high = min(tops), max(tops)
            ax.set_ylim(low - 0.05 * (high - low) - 0.01, high + 0.15 * (high - low) + 0.01)
        size = f"{main_params / 1e6:.2f}M" if family == "main" else f"tiny {fast_params / 1e3:.0f}K"
        ax.set_title(f"model {size}, H={h_every} (dashed: F>1)")
        ax.set_xlabel("samples seen (thousands)")
        ax.set_ylabel("validation loss (nats per byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    h.progress(f"plot: {path}")
    return str(path)
