"""The quality benchmark's Moshpit arms: Moshpit SGD's small groups against DiLoCo at N = 8
learner processes, each of the 4 shards cut in two contiguous halves (``--arms moshpit``; run
by ``quality.run`` after the others, through its ``Bench``): ``diloco-N`` (the reference,
same run), ``moshpit-M2`` (a full 2x2x2 grid), ``moshpit-M4`` (8 of 16 cells), ``ddp-N`` and
``solo-average-N`` in one process. A generous ``round_timeout`` lets a group close because
all its members came, not by the clock (short groups and ``missed_groups`` say whether one
did). Evaluated after the learners finished: ``gm.align`` in another process (for Moshpit:
the sample-weighted average of the newest group round's commits) and the learners' own
models. Target: each Moshpit arm's loss within 3% of ``diloco-N``'s.

    .venv/bin/python -m bench.quality_moshpit --quick   # = python -m bench.quality --arms moshpit
    .venv/bin/python -m bench.quality_moshpit --tiny    # 4 learners, M=2, d=2: seconds
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench import _harness as h
from bench import _lm
from bench import _quality_report as qr
from bench import quality as q
from gradientmail.demo import lm

NAME = "quality-moshpit"
OPTIONS = "moshpit"  # their options: ctx.options["quality"]["moshpit"]
ARM_NAMES = frozenset({"moshpit", "moshpit-M2", "moshpit-M4"})
TITLE = "8b. Training quality: Moshpit groups against DiLoCo"
REFERENCE = "`diloco-N` (DiLoCo, same N learner processes, same data, same run)"
LEARNERS = 8
TARGET = 0.03  # a Moshpit arm's validation loss at most 3% above diloco-N's
ROUND_TIMEOUT = 600.0  # generous: a group closes when all its members came
LEASE_TIMEOUT = 60.0  # 8 processes on 2 cores: a starved heartbeat must not look gone

TINY = _lm.Sizes(
    model=lm.ModelSize(d_model=16, layers=1, heads=2),
    fast_model=lm.ModelSize(d_model=16, layers=1, heads=2),
    batch=2,
    steps=24,
    fast_steps=24,
    context=16,
    checkpoints=3,
    eval_windows=8,
    sync_every=(4,),
    fragments=(1,),
    max_stdlib_bytes=100_000,
)
"""``--tiny`` and the test: a model of a few thousand parameters, 24 steps, H = 4."""


@dataclass(frozen=True)
class Grid:
    """A Moshpit arm's grid: ``group_size`` M, ``grid_dims`` d."""

    group_size: int
    grid_dims: int

    @property
    def key(self) -> str:
        return f"moshpit-M{self.group_size}"

    @property
    def cells(self) -> int:
        return int(self.group_size**self.grid_dims)

    def spec(self) -> dict[str, Any]:
        """The learners' algorithm (``_quality_worker.make_algorithm``)."""
        return {
            "name": "moshpit",
            "settings": {"group_size": self.group_size, "grid_dims": self.grid_dims},
        }

    def describe(self, learners: int) -> str:
        full = "full grid" if learners == self.cells else f"{learners} of {self.cells} cells"
        return f"M={self.group_size} d={self.grid_dims} ({full})"

    def expected(self, learners: int, t: int) -> dict[str, int]:
        """Group key -> members expected in group round ``t`` when the slots ``0 ..
        learners-1`` are held (dense slots keep their cells: ``moshpit.next_index``)."""
        from gradientmail.algorithms.moshpit import group_key, initial_index

        return dict(
            Counter(
                group_key(initial_index(s, self.group_size, self.grid_dims), t)
                for s in range(learners)
            )
        )


DEFAULT_GRIDS = (Grid(2, 3), Grid(4, 2))


# -- sizes and data --------------------------------------------------------------------------


def sizes_for(ctx: h.Context) -> _lm.Sizes:
    """``options["sizes"]`` when given; ``--tiny``: :data:`TINY`; else ``quality.py``'s preset
    (``--quick``: d_model 64, 2 layers, B = 4, 300 steps) with its smallest H and F = 1."""
    options = _options(ctx)
    given = options.get("sizes")
    if given is not None:
        return given if isinstance(given, _lm.Sizes) else _lm.Sizes.from_json(given)
    if options.get("tiny"):
        return TINY
    base = q.sizes_for(h.Context(ctx.quick, ctx.large, ctx.workdir))
    values = base.to_json() | {"sync_every": [min(base.sync_every)], "fragments": [1]}
    if options.get("steps"):
        values["steps"] = values["fast_steps"] = int(options["steps"])
    return _lm.Sizes.from_json(values)


def split_shards(
    shards: Sequence[torch.Tensor], learners: int
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """One shard per learner: with more learners than shards (a multiple of them), each
    shard cut into ``learners / len(shards)`` contiguous parts; with fewer, the shards
    ``j`` with ``j % learners == i`` joined for learner ``i``. Also what each learner got."""
    n = len(shards)
    out: list[torch.Tensor] = []
    what: list[dict[str, Any]] = []
    if learners <= n:
        for i in range(learners):
            mine = [j for j in range(n) if j % learners == i]
            out.append(torch.cat([shards[j] for j in mine]) if len(mine) > 1 else shards[i])
            what.append(
                {"learner": i, "shards": mine, "part": "whole", "bytes": int(out[-1].numel())}
            )
        return out, what
    if learners % n:
        raise ValueError(f"{learners} learners: a multiple of the {n} shards, or at most {n}")
    parts = learners // n
    for j, shard in enumerate(shards):
        size = int(shard.numel())
        for k in range(parts):
            lo, hi = size * k // parts, size * (k + 1) // parts
            out.append(shard[lo:hi].clone())
            what.append(
                {
                    "learner": j * parts + k,
                    "shards": [j],
                    "part": f"{k + 1}/{parts}",
                    "bytes": hi - lo,
                }
            )
    return out, what


# -- the arms --------------------------------------------------------------------------------


def grid_of(arm: q.Arm) -> Grid | None:
    """A Moshpit arm's grid, from its learners' algorithm; None for the other arms."""
    settings = (arm.algorithm or {}).get("settings")
    return Grid(int(settings["group_size"]), int(settings["grid_dims"])) if settings else None


def wanted(arms: set[str]) -> bool:
    """Whether the quality benchmark's ``arms`` ask for the Moshpit comparison."""
    return bool(arms & ARM_NAMES)


def _options(ctx: h.Context) -> dict[str, Any]:
    return dict(ctx.options.get(q.NAME, {}).get(OPTIONS) or {})


def run_learners(bench: q.Bench, arm: q.Arm, options: Mapping[str, Any]) -> None:
    """``arm.learners`` learner processes on a new file mailbox (``Bench.run_diloco``, with
    this comparison's timeouts), then ``gm.align`` and the learners' own models evaluated."""
    assert arm.learners is not None
    grid = grid_of(arm)
    params = [bench.dir / f"{arm.key}.learner-{i}.params.pt" for i in range(arm.learners)]
    timeouts = {
        "round_timeout": float(options.get("round_timeout", ROUND_TIMEOUT)),
        "lease_timeout": float(options.get("lease_timeout", LEASE_TIMEOUT)),
        "poll_interval": options.get("poll_interval"),
    }
    done = bench.run_diloco(
        arm,
        bench.file_box,
        lambda i: timeouts | {"save_params": str(params[i])},
        {"sync_every": arm.sync_every, "learner_params": [str(p) for p in params]}
        | {"groups": grid is not None},
    )
    if done is None:
        return
    arm.data |= traffic(*done, grid, arm.learners)
    h.progress(
        f"{arm.key}: validation loss {arm.final_loss:.4f} (own {_spread(arm)}), "
        f"{arm.data['rounds_per_learner']:.1f} rounds/learner, missed groups "
        f"{arm.data['missed_groups']}, {arm.wall_s:.0f} s"
    )


def traffic(
    learners: Sequence[Mapping[str, Any]], ev: Mapping[str, Any], grid: Grid | None, n: int
) -> dict[str, Any]:
    """Bytes per learner per round applied, missed groups, waits; for Moshpit the group
    rounds' shapes against the grid's (a group short of its expected members closed by
    ``round_timeout`` or without a member that came late)."""

    def total(name: str) -> Any:
        numbers = [v for r in learners if isinstance(v := r["counters"].get(name), int | float)]
        return sum(numbers) if numbers else None

    group_rounds = ev.get("group_rounds") or []
    per = qr.per_round(learners, len(group_rounds if grid else ev.get("rounds") or []))
    out: dict[str, Any] = {
        "bytes_per_round": per,
        "rounds_per_learner": per["applied"],
        "missed_groups": total("missed_groups"),
        "waits_total": total("waits"),
        "waited_s_max": max(float(r["counters"].get("waited_s", 0.0)) for r in learners),
        "wait_timeouts": total("wait_timeouts"),
    }
    if grid is None:
        return out
    sizes: Counter[int] = Counter()
    short: list[str] = []
    for entry in group_rounds:
        t = int(entry["round"])
        expected = grid.expected(n, t)
        for g in entry["groups"]:
            sizes[len(g["members"])] += 1
            if len(g["members"]) < expected.get(g["group"], 0):
                short.append(f"{t}/{g['group']}: {len(g['members'])} of {expected[g['group']]}")
        missing = set(expected) - {g["group"] for g in entry["groups"]}
        short += [f"{t}/{g}: no commit" for g in sorted(missing)]
    return out | {
        "group_rounds": len(group_rounds),
        "group_commits": sum(len(e["groups"]) for e in group_rounds),
        "group_sizes": {str(k): v for k, v in sorted(sizes.items())},
        "short_groups": short,
        "excluded": sum(len(g["excluded"]) for e in group_rounds for g in e["groups"]),
        "align_log": list(ev.get("align_log") or []),
        "align_matches_groups": ev.get("align_matches_groups"),
    }


def _spread(row: q.Arm) -> str:
    values = row.learner_losses
    return f"{sum(values) / len(values):.4f} / {max(values):.4f}" if values else "-"


# -- the run ---------------------------------------------------------------------------------


def run_arms(ctx: h.Context, report: h.Report) -> None:
    """These arms, their tables and targets added to the quality benchmark's ``report``;
    ``ctx.options["quality"]["moshpit"]``: ``learners`` (8), ``grids`` (``[[M, d], ...]``),
    ``tiny``, ``sizes``, ``steps``, ``inprocess`` (ddp and solo-average: True),
    ``round_timeout``, ``lease_timeout``, ``poll_interval``. Named arms (``moshpit-M2``) run
    only their grid."""
    import gradientmail as gm

    options = _options(ctx)
    learners = int(options.get("learners", LEARNERS))
    grids = [Grid(int(m), int(d)) for m, d in options.get("grids") or []] or list(DEFAULT_GRIDS)
    named = set(ctx.options.get(q.NAME, {}).get("arms") or ()) & ARM_NAMES
    if "moshpit" not in named:
        grids = [g for g in grids if g.key in named]
    sizes = sizes_for(ctx)
    h_every = min(sizes.sync_every)
    if report.title == TITLE:  # the comparison alone
        report.title = f"{TITLE} at {learners} learners"
        report.reference = (
            f"`diloco-{learners}` (DiLoCo H={h_every}, F=1, {learners} learner processes, same "
            "data, same run)"
        )
    started = time.monotonic()
    with q.Bench(ctx, sizes) as bench:
        h.progress("reading the standard library's sources")
        corpus = sizes.corpus()
        shards, what = split_shards(corpus.shards, learners)
        bench.save_data(shards, corpus.val)
        library = q.library_commit() | {"gradientmail_file": gm.__file__}
        params = lm.param_count(sizes.model, sizes.context)
        h.progress(
            f"corpus: {corpus.train_bytes / 1e6:.1f} MB train in {learners} shards; model "
            f"{params / 1e6:.3f}M params; {sizes.steps} steps of B={sizes.batch}, H={h_every}"
        )
        arms = [(f"diloco-{learners}", "diloco", f"DiLoCo H={h_every} F=1", None)]
        arms += [
            (g.key, "moshpit", f"Moshpit H={h_every} {g.describe(learners)}", g.spec())
            for g in grids
        ]
        for key, kind, described, algorithm in arms:
            arm = q.Arm(key, kind, "main", h_every, 1, backend="file", algorithm=algorithm)
            arm.learners, arm.described = learners, described
            run_learners(bench, arm, options)
        if options.get("inprocess", True):  # ddp and solo-average over the N shards
            bench.run_inprocess(
                [
                    bench.inprocess(f"{kind}-{learners}", kind, "main", learners=learners)
                    for kind in ("ddp", "solo-average")
                ]
            )
        build_report(report, bench.arms, options, corpus, what, sizes, library, params, learners)
        report.data[OPTIONS]["seconds"] = time.monotonic() - started


LOSS_NOTE = (
    "Learner arms: N processes on a file mailbox, evaluated as a user would, after they "
    "finished: `gm.align` in another process (Moshpit: the sample-weighted average of the "
    "newest group round's group commits; `align` logs which). `learners' own`: the validation "
    "loss of each learner's own final model (mean / max); solo-average: of each copy. Rounds: "
    "group rounds a learner applied (DiLoCo: rounds). Bytes: each learner's `counters()` "
    "bytes_up + bytes_down (every key kind) over the rounds it applied, averaged over "
    "learners. Missed groups: `counters().missed_groups` summed over learners; short groups: "
    "group commits with fewer members than their line of the grid holds. Waits: times "
    "`step()` held training for a commit, summed over learners (the longest total wait of one "
    "learner). Wall: the slowest learner's training + close (in-process arms: one process)."
)


def build_report(
    report: h.Report,
    rows: Mapping[str, q.Arm],
    options: Mapping[str, Any],
    corpus: lm.Corpus,
    what: Sequence[Mapping[str, Any]],
    sizes: _lm.Sizes,
    library: Mapping[str, Any],
    params: int,
    n: int,
) -> None:
    h_every = min(sizes.sync_every)
    parts = len(corpus.shards)
    cut = f"each cut into {n // parts} contiguous parts (different files of the same package group)"
    h.spec_table(
        report,
        f"Data: the stdlib's .py sources ({corpus.files} files), {n} non-IID shards",
        [
            ("learner", lambda e: _lm.learner_id(e["learner"])),
            (
                "package group (quality.py's shard)",
                lambda e: ", ".join(lm.SHARD_NAMES[j].split(" (")[0] for j in e["shards"]),
            ),
            ("part", lambda e: e["part"]),
            ("bytes", lambda e: h.size(float(e["bytes"]))),
        ],
        what,
        f"quality.py's {parts} shards by top-level package, "
        + (cut if n > parts else "joined round-robin")
        + f". Validation: {sizes.eval_windows} fixed windows of the held-out 5%. Model "
        f"{params / 1e6:.3f}M params (d_model {sizes.model.d_model}, {sizes.model.layers} "
        f"layers, {sizes.model.heads} heads, context {sizes.context}); AdamW lr "
        f"{sizes.lr:g}; B = {sizes.batch} per learner, {sizes.steps} local steps, H = "
        f"{h_every}: {sizes.steps // h_every} sync points; T = "
        f"{n * sizes.batch * sizes.steps} samples; {sizes.threads} torch thread per process.",
    )
    ref = rows.get(f"diloco-{n}")
    ref_loss = ref.final_loss if ref is not None and not ref.error else math.nan

    def cells(row: q.Arm) -> list[object]:
        if row.error:
            return [row.key, row.setting, f"ERROR: {row.error}", *[""] * 8]
        d = row.data
        per, waits, grid = d.get("bytes_per_round"), d.get("waits_total"), grid_of(row)
        return [
            row.key,
            row.setting,
            f"{row.final_loss:.4f}",
            "reference" if row is ref else h.change(row.final_loss, ref_loss),
            _spread(row),
            h.num(d.get("rounds_per_learner"), "{:.1f}") if per else "-",
            f"{h.size(per['total'])} (up {h.size(per['up'])})" if per else "-",
            h.num(d.get("missed_groups")) if grid else "-",
            str(len(d.get("short_groups") or [])) if grid else "-",
            f"{h.num(waits)} ({h.num(d.get('waited_s_max'), '{:.1f}')})" if per else "-",
            h.secs(row.wall_s),
        ]

    headers = [
        "arm",
        "setting",
        "loss (aligned)",
        f"vs diloco-{n}",
        "learners' own: mean / max",
        "rounds / learner",
        "bytes / learner / round: up+down (up)",
        "missed groups",
        "short groups",
        "waits (max s)",
        "wall (training)",
    ]
    title = "Validation loss (nats per byte; lower is better) and traffic per arm"
    table = report.table(title, headers, note=LOSS_NOTE)
    for row in rows.values():
        table.add(*cells(row))
    moshpit = [r for r in rows.values() if grid_of(r) is not None]

    def groups(row: q.Arm) -> list[object]:
        d, grid = row.data, grid_of(row)
        assert grid is not None
        if row.error:
            return [row.key, grid.describe(n), f"ERROR: {row.error}", *[""] * 6]
        shapes = ", ".join(f"{k}: {v}" for k, v in (d.get("group_sizes") or {}).items())
        loaded = (m.removeprefix("align: loaded ") for m in d.get("align_log") or [])
        return [
            row.key,
            grid.describe(n),
            d.get("group_rounds"),
            d.get("group_commits"),
            shapes or "-",
            "; ".join(d.get("short_groups") or []) or "0",
            d.get("excluded"),
            "; ".join(loaded) or "-",
            d.get("align_matches_groups"),
        ]

    if moshpit:
        table = report.table(
            "Moshpit group rounds (from the mailbox after the run)",
            [
                "arm",
                "grid",
                "group rounds",
                "group commits",
                "members per group: commits",
                "short groups",
                "excluded",
                "align loaded",
                "align = average of newest round",
            ],
            note=(
                "Every group commit (`group-rounds/`, none swept): its members; a short group "
                "has fewer members than its line of the grid holds with these slots."
            ),
        )
        for row in moshpit:
            table.add(*groups(row))
    for row in moshpit:
        grid = grid_of(row)
        name = f"validation loss within 3% of diloco-{n}"
        if row.error or math.isnan(ref_loss):
            why = row.error or f"no diloco-{n} loss"
            goal = f"<= {100 * TARGET:.0f}% above diloco-{n}"
            report.target(f"{row.key} {name}", "n/a", goal, None, why)
            continue
        gap = row.final_loss / ref_loss - 1
        report.target(
            f"{row.key} ({grid.describe(n) if grid else ''}) {name}",
            f"{row.final_loss:.4f} vs {ref_loss:.4f} ({100 * gap:+.2f}%)",
            f"<= +{100 * TARGET:.0f}%",
            gap <= TARGET,
        )
    curves = report.table(
        "Loss curves (validation loss at each checkpoint: samples seen by all learners)",
        ["arm", *[str(x) for x, _ in next((r.curve for r in rows.values() if r.curve), [])]],
        note=(
            "Learner arms: DiLoCo's newest commit at or before the checkpoint; Moshpit's "
            "newest group round at or before it, its group commits averaged as `align` does."
        ),
    )
    for row in rows.values():
        if row.curve:
            curves.add(row.key, *[f"{y:.4f}" for _, y in row.curve])
    solo = rows.get(f"solo-average-{n}")
    if solo is not None and not solo.error and not math.isnan(ref_loss):
        report.notes.append(scale_note(solo, ref_loss, rows.get(f"ddp-{n}"), moshpit, n))
    report.notes.append(
        f"Learners: {n} processes, round_timeout "
        f"{float(options.get('round_timeout', ROUND_TIMEOUT)):g} s, lease_timeout "
        f"{float(options.get('lease_timeout', LEASE_TIMEOUT)):g} s, overlap: the Session "
        "default; grid slots are claimed in join order, so which shard sits in which cell "
        "varies between runs."
    )
    report.data[OPTIONS] = {
        "learners": n,
        "sizes": sizes.to_json(),
        "library": dict(library),
        "corpus": corpus.describe(),
        "shards": list(what),
        "target": TARGET,
        "arms": [
            h.fields(arm, "key")
            | {"kind": arm.arm, "setting": arm.setting}
            | {"grid": None if (g := grid_of(arm)) is None else [g.group_size, g.grid_dims]}
            | h.fields(arm, "final_loss learner_losses curve wall_s error data")
            for arm in rows.values()
        ],
    }


def scale_note(
    solo: q.Arm, ref_loss: float, ddp: q.Arm | None, moshpit: Sequence[q.Arm], n: int
) -> str:
    """How wide the target's 3% is at this size: the gap no communication at all leaves,
    and the share of it each Moshpit arm closes."""
    gap = solo.final_loss - ref_loss
    words = (
        f"For scale: solo-average-{n} (no communication, one average at the end) is "
        f"{h.change(solo.final_loss, ref_loss)} from diloco-{n}"
    )
    if ddp is not None and not ddp.error:
        words += f", ddp-{n} {h.change(ddp.final_loss, ref_loss)}"
    closed = [
        f"{r.key} {100 * (solo.final_loss - r.final_loss) / gap:.0f}%"
        for r in moshpit
        if not r.error and gap > 0
    ]
    if closed:
        words += (
            "; of the gap between no communication and DiLoCo the Moshpit arms close "
            + ", ".join(closed)
        )
    return words + "."


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.quality_moshpit``: ``python -m bench.quality --arms moshpit``."""
    rest = list(sys.argv[1:] if argv is None else argv)
    return q.main(["--arms", "moshpit", *rest], prog="python -m bench.quality_moshpit")


if __name__ == "__main__":
    sys.exit(main())
