"""Moshpit averaging — the spread of the learners' vectors after each group round, on the
library's grid (``gradientmail.algorithms.moshpit``), against the paper's claims and against
random groups of the same size.

N learners each hold a random float64 vector (dimension 1000; ``--quick`` 100); learner
``i`` holds slot ``i`` and starts at ``initial_index(i, M, d)``. In group round ``t`` each
learner that takes part joins the learners of its ``group_key(index, t)``; the members take
the sample-weighted sum with :meth:`Moshpit.weights`, then move with ``next_index``. Dropout:
each learner skips each round with probability 0, 10% or 30% (fixed seeds), keeping its
vector and index. The baseline cuts the same live learners, shuffled, into groups of M.

Measured per (M, d, N, dropout), mean over trials: the relative spread (mean over learners of
||x_i − x̄||² over its initial value, x̄ the mean of the initial vectors, sample-weighted in
the unequal-samples table) after every round; the drift of the mean (sample-weighted
averaging preserves it, dropped learners included); the per-round decay factor fitted on log
spread, beside (N − M) / (M (N − 1)) for random groups without dropout. The paper's claims:
on a full grid (N = M^d) without dropout the spread is exactly 0 after d rounds (< 1e-20
relative here); with dropout it falls exponentially; the grid beats random groups.
Configurations: full grids M=2, d=2..7; M=4, d=2, 3; M=8 and M=10, d=2; a partial grid N=100
on M=4, d=4; an over-full one, N=80 on M=4, d=3 (slots past 63 wrap around).

    .venv/bin/python -m bench.averaging [--quick] [--plot PATH] [--out PATH]
    .venv/bin/python -m bench averaging [--quick]       # within the suite
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from gradientmail.algorithms.moshpit import Moshpit, group_key, initial_index, next_index

NAME = "averaging"
DROPOUTS = (0.0, 0.1, 0.3)
EXACT = 1e-20  # relative spread below which a full grid counts as exact after d rounds
FIT_FLOOR = 1e-12  # the fit ignores rounds at or below this spread (rounding, exact zeros)
TARGET = 1e-6  # "rounds to < 1e-6"
PLOT_FLOOR = 1e-34  # exact zeros drawn here on the log axis
EQUAL_HEADER = [
    "M", "d", "N", "grid", "dropout", "after 1", "after d", "after 2d", "rounds to < 1e-06",
    "fitted decay/round", "exact after d", "mean drift (max)", "random after d",
    "random after 2d", "random decay/round (theory)", "grid/random after d",
    "grid/random after 2d",
]  # fmt: skip
UNEQUAL_HEADER = [
    "M", "d", "N", "grid", "dropout", "after d", "after 2d", "fitted decay/round",
    "weighted-mean drift (max)", "final mean to weighted x̄", "final mean to plain x̄",
]  # fmt: skip

Index = tuple[int, ...]
Array = NDArray[np.float64]


@dataclass(frozen=True)
class Config:
    group_size: int  # M
    grid_dims: int  # d
    learners: int  # N

    @property
    def cells(self) -> int:
        return int(self.group_size**self.grid_dims)

    @property
    def kind(self) -> str:
        if self.learners == self.cells:
            return "full"
        return "partial" if self.learners < self.cells else "over-full"

    @property
    def label(self) -> str:
        return f"M={self.group_size} d={self.grid_dims} N={self.learners}"


def _full(m: int, d: int) -> Config:
    return Config(m, d, m**d)


FULL = (
    *(_full(2, d) for d in range(2, 8)), _full(4, 2), _full(4, 3), _full(8, 2), _full(10, 2),
    Config(4, 4, 100), Config(4, 3, 80),
)  # fmt: skip
QUICK = (_full(2, 3), _full(4, 2), Config(4, 2, 10))


@dataclass
class Curve:
    """Mean over trials of one (config, dropout, grouping, weighting)."""

    config: Config
    dropout: float
    grouping: str  # "grid" or "random"
    weighted: bool
    spread: list[float]  # relative spread after rounds 0, 1, ..., R
    drift: float  # max over rounds and trials of ||mean_t − x̄||² / initial spread
    to_weighted: float  # ||mean of the final vectors − sample-weighted x̄||² / initial spread
    to_plain: float  # the same to the plain mean of the initial vectors

    def at(self, k: int) -> float:
        return self.spread[min(k, len(self.spread) - 1)]

    def rounds_to(self, level: float) -> int | None:
        return next((k for k, s in enumerate(self.spread) if s < level), None)

    def decay(self) -> float:
        return fit_decay(self.spread)


def fit_decay(spread: Sequence[float], floor: float = FIT_FLOOR) -> float:
    """exp(slope) of log spread against round, least squares over the rounds above ``floor``."""
    return math.exp(
        h.least_squares([(k, math.log(s)) for k, s in enumerate(spread) if s > floor])[0]
    )


def learner_id(i: int) -> str:
    return f"L{i:04d}"  # zero-padded: string order is slot order


def average(x: Array, members: Sequence[int], samples: NDArray[np.int64], algo: Moshpit) -> None:
    """Replace the members' vectors by their sample-weighted mean (:meth:`Moshpit.weights`)."""
    if len(members) < 2:
        return
    weights, _ = algo.weights([(learner_id(i), int(samples[i])) for i in members], None)
    x[list(members)] = np.asarray(weights) @ x[list(members)]


def grid_round(
    x: Array,
    index: Sequence[Index],
    t: int,
    live: NDArray[np.bool_],
    samples: NDArray[np.int64],
    algo: Moshpit,
) -> list[Index]:
    """Group round ``t`` on the grid: the live learners meet by ``group_key`` and average;
    the new indices (``next_index``; dropped learners keep theirs)."""
    groups: dict[str, list[int]] = {}
    for i in np.flatnonzero(live).tolist():
        groups.setdefault(group_key(index[i], t), []).append(i)
    new = list(index)
    for members in groups.values():
        average(x, members, samples, algo)
        listed = [(learner_id(i), index[i]) for i in members]
        for i in members:
            new[i] = next_index(index[i], t, listed, learner_id(i), algo.group_size)
    return new


def random_round(
    x: Array,
    live: NDArray[np.bool_],
    samples: NDArray[np.int64],
    algo: Moshpit,
    rng: np.random.Generator,
) -> None:
    """The baseline: shuffle the live learners, cut them into groups of M, average each."""
    order = rng.permutation(np.flatnonzero(live))
    m = algo.group_size
    for k in range(0, len(order), m):
        average(x, sorted(int(i) for i in order[k : k + m]), samples, algo)


def simulate(
    config: Config,
    dropout: float,
    grouping: str,
    *,
    trials: int,
    rounds: int,
    dim: int,
    seed: int,
    weighted: bool = False,
) -> Curve:
    n, m, d = config.learners, config.group_size, config.grid_dims
    algo = Moshpit(sync_every=1, group_size=m, grid_dims=d)
    spread = np.zeros((trials, rounds + 1))
    drift = to_weighted = to_plain = 0.0
    for trial in range(trials):
        # The same vectors, samples and dropouts for both groupings and for every dropout
        # rate (a learner dropped at 10% is dropped at 30% too).
        rng = np.random.default_rng([seed, trial, n, m, d])
        x = rng.standard_normal((n, dim))
        drawn = rng.integers(1, 1001, n)
        samples = drawn if weighted else np.full(n, 100, dtype=np.int64)
        live_masks = rng.random((rounds, n)) >= dropout
        shuffler = np.random.default_rng([seed, trial, n, m, d, 1])
        w = samples / samples.sum()
        center, plain = w @ x, x.mean(axis=0)
        initial = float(np.mean(np.sum((x - center) ** 2, axis=1)))
        index = [initial_index(slot, m, d) for slot in range(n)]
        spread[trial, 0] = 1.0
        for t in range(1, rounds + 1):
            live = live_masks[t - 1]
            if grouping == "grid":
                index = grid_round(x, index, t, live, samples, algo)
            else:
                random_round(x, live, samples, algo, shuffler)
            spread[trial, t] = float(np.mean(np.sum((x - center) ** 2, axis=1))) / initial
            drift = max(drift, float(np.sum((w @ x - center) ** 2)) / initial)
        final = x.mean(axis=0)
        to_weighted += float(np.sum((final - center) ** 2)) / initial / trials
        to_plain += float(np.sum((final - plain) ** 2)) / initial / trials
    mean = [float(s) for s in spread.mean(axis=0)]
    return Curve(config, dropout, grouping, weighted, mean, drift, to_weighted, to_plain)


def random_theory(config: Config) -> float:
    """E[spread after] / spread for a uniform partition of N into groups of M (no dropout)."""
    n, m = config.learners, config.group_size
    return (n - m) / (m * (n - 1)) if n % m == 0 else math.nan


def sci(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2e}"


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 or math.isnan(a) or math.isnan(b) else f"{a / b:.1e}"


def run(ctx: h.Context) -> h.Report:
    opts: dict[str, Any] = dict(ctx.options.get(NAME, {}))
    configs: Sequence[Config] = opts.get("configs") or ctx.pick(FULL, QUICK)
    trials = int(opts.get("trials", ctx.pick(8, 2)))
    dim = int(opts.get("dim", ctx.pick(1000, 100)))
    rounds_min = int(opts.get("rounds", ctx.pick(40, 12)))
    seed = int(opts.get("seed", 20210304))
    report = h.Report(
        NAME,
        "Moshpit averaging: relative spread per group round, grid vs random groups",
        "random groups of M (same vectors, same dropouts); the paper's claims: exact after "
        "d rounds on a full grid, exponential decay under dropout",
    )
    curves: list[tuple[Curve, Curve, Curve]] = []
    for config in configs:
        d = config.grid_dims
        rounds = max(3 * d, rounds_min)
        h.progress(f"{NAME}: {config.label} ({config.kind}), {trials} trials, {rounds} rounds")
        for p in DROPOUTS:
            kw: dict[str, Any] = dict(trials=trials, rounds=rounds, dim=dim, seed=seed)
            grid, rand = simulate(config, p, "grid", **kw), simulate(config, p, "random", **kw)
            curves.append((grid, rand, simulate(config, p, "grid", weighted=True, **kw)))
    equal = report.table(
        f"Equal samples: relative spread (mean of {trials} trials, dimension {dim})",
        EQUAL_HEADER,
        note="spread: mean over learners of ||x_i − x̄||² / its initial value, x̄ the mean of "
        "the initial vectors; mean drift: max over rounds of ||mean_t − x̄||² / initial "
        "spread; fitted decay: exp(slope) of least squares on log spread over rounds with "
        f"spread > {FIT_FLOOR:.0e}; random theory: (N − M)/(M (N − 1)), no dropout only.",
    )
    unequal = report.table(
        "Unequal samples (1..1000 per learner, fixed): spread around the sample-weighted mean",
        UNEQUAL_HEADER,
        note="final mean: the mean of the learners' vectors after the last round; distances "
        "are ||·||² / initial spread. Each learner contributes the same sample count every "
        "round.",
    )
    exact_ok: list[bool] = []
    beats: dict[float, list[bool]] = {p: [] for p in DROPOUTS}
    for grid, rand, weighted in curves:
        c, p = grid.config, grid.dropout
        d = c.grid_dims
        exact = "-"
        if p == 0:  # the claim is the full grid's; the others' are shown for comparison
            exact = f"{'yes' if grid.at(d) < EXACT else 'no'} ({sci(grid.at(d))})"
            if c.kind == "full":
                exact_ok.append(grid.at(d) < EXACT)
        if c.kind == "full":
            beats[p].append(grid.at(d) <= rand.at(d))
        to = grid.rounds_to(TARGET)
        theory = sci(random_theory(c)) if p == 0 else "-"
        head = (c.group_size, d, c.learners, c.kind, f"{p:.0%}")
        equal.add(
            *head, sci(grid.at(1)), sci(grid.at(d)), sci(grid.at(2 * d)),
            to if to is not None else f"> {len(grid.spread) - 1}", f"{grid.decay():.3f}",
            exact, sci(grid.drift), sci(rand.at(d)), sci(rand.at(2 * d)),
            f"{rand.decay():.3f} ({theory})", _ratio(grid.at(d), rand.at(d)),
            _ratio(grid.at(2 * d), rand.at(2 * d)),
        )  # fmt: skip
        unequal.add(
            *head, sci(weighted.at(d)), sci(weighted.at(2 * d)), f"{weighted.decay():.3f}",
            sci(weighted.drift), sci(weighted.to_weighted), sci(weighted.to_plain),
        )  # fmt: skip
    report.target(
        "full grid, no dropout: relative spread after d rounds",
        f"{sum(exact_ok)}/{len(exact_ok)} below {EXACT:.0e}",
        f"< {EXACT:.0e} (exact)",
        all(exact_ok) if exact_ok else None,
    )
    for p, wins in beats.items():
        report.target(
            f"full grid vs random groups, dropout {p:.0%}: spread after d rounds",
            f"grid ≤ random in {sum(wins)}/{len(wins)} configs",
            "grid ≤ random in every config",
            all(wins) if wins else None,
        )
    report.data = {
        "trials": trials,
        "dim": dim,
        "seed": seed,
        "curves": [asdict(cv) for trio in curves for cv in trio],
    }
    report.notes.append(f"plot: {write_plot([trio[:2] for trio in curves], plot_path(ctx))}")
    return report


def plot_path(ctx: h.Context) -> Path:
    given = ctx.options.get(NAME, {}).get("plot")
    if given:
        return Path(given)
    record = ctx.options.get("json_path")
    if record:
        return Path(record).with_name(f"{Path(record).stem}-averaging.png")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return h.ROOT / "bench" / "results" / f"averaging-{stamp}.png"


def write_plot(pairs: Sequence[tuple[Curve, ...]], path: Path) -> str:
    """Relative spread per round, log y: one panel per dropout, one colour per config, the
    grid solid and random groups dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        h.progress(f"no plot: {exc} (pip install matplotlib)")
        return f"not written: {exc}"
    labels = list(dict.fromkeys(pair[0].config.label for pair in pairs))
    cmap = plt.get_cmap("tab20" if len(labels) > 10 else "tab10")
    fig, axes = plt.subplots(1, len(DROPOUTS), figsize=(6 * len(DROPOUTS), 5.5), sharey=True)
    for ax, p in zip(axes, DROPOUTS, strict=True):
        for pair in pairs:
            if pair[0].dropout != p:
                continue
            colour = cmap(labels.index(pair[0].config.label))
            for curve, style in zip(pair, ("-", "--"), strict=False):
                ys = [max(s, PLOT_FLOOR) for s in curve.spread]
                label = f"{curve.config.label} ({curve.config.kind})" if style == "-" else None
                ax.plot(range(len(ys)), ys, style, color=colour, label=label, linewidth=1.2)
        ax.axhline(TARGET, color="gray", linewidth=0.6, linestyle=":")
        ax.set_yscale("log")
        ax.set_ylim(PLOT_FLOOR / 10, 3)
        ax.set_title(f"dropout {p:.0%} (solid: grid, dashed: random groups)")
        ax.set_xlabel("group round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"relative spread (exact zeros drawn at {PLOT_FLOOR:.0e})")
    axes[0].legend(fontsize=7)
    return h.save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.averaging``: this benchmark alone; the report on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.averaging", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="three small configs, 2 trials")
    parser.add_argument(
        "--plot",
        type=Path,
        default=h.ROOT / "docs" / "moshpit-averaging.png",
        help="where the PNG goes (default: docs/moshpit-averaging.png)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    parser.add_argument("--trials", type=int, default=None, help="trials per configuration")
    args = parser.parse_args(argv)
    options = {"plot": str(args.plot)} | ({} if args.trials is None else {"trials": args.trials})
    h.alone(run, quick=args.quick, options={NAME: options}, markdown=args.out, header=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
