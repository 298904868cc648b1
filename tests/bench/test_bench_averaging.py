"""The Moshpit averaging benchmark (``bench/averaging.py``) and the grid invariants it rests
on: a full grid with no dropout holds the exact mean after ``d`` rounds, sample-weighted
group averaging preserves the mean of all learners under dropout, and two learners that
meet in one round are apart the next."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from bench import averaging
from gradientmail.algorithms.moshpit import Moshpit, group_key, initial_index, next_index


def _rows(markdown: str, title: str) -> list[dict[str, str]]:
    """The rows of the table under ``### {title}…`` as dicts keyed by the header."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"### {title}"))
    table = list(itertools.takewhile(lambda s: s.startswith("|"), lines[start + 2 :]))
    header = [c.strip() for c in table[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in row.strip("|").split("|")), strict=True))
        for row in table[2:]
    ]


def test_quick_benchmark_reports_every_config_and_an_exact_full_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot, out = tmp_path / "spread.png", tmp_path / "averaging.md"
    assert averaging.main(["--quick", "--plot", str(plot), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text().strip() == printed.strip()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = _rows(printed, "Equal samples")
    expected = [
        (str(c.group_size), str(c.grid_dims), str(c.learners), f"{p:.0%}")
        for c in averaging.QUICK
        for p in averaging.DROPOUTS
    ]
    assert [(r["M"], r["d"], r["N"], r["dropout"]) for r in rows] == expected
    assert len(_rows(printed, "Unequal samples")) == len(expected)

    full = [r for r in rows if r["grid"] == "full"]
    assert full  # the quick set has full grids
    for row in full:
        if row["dropout"] == "0%":
            assert float(row["after d"]) < 1e-20, row
            assert row["exact after d"].startswith("yes"), row
            # Random groups of M are not exact after d rounds.
            assert float(row["random after d"]) > 1e-6, row
        else:  # with dropout the grid is not exact, but the spread still falls
            assert 1e-20 < float(row["after d"]) < float(row["after 1"]) < 1.0, row
        # Equal weights preserve the mean (the drift is rounding, float64).
        assert float(row["mean drift (max)"]) < 1e-25, row


@pytest.mark.parametrize("equal", [True, False])
def test_weighted_group_rounds_preserve_the_mean_under_dropout(equal: bool) -> None:
    """Σ samples_i x_i is invariant: each group replaces its members' vectors by their
    sample-weighted mean and dropped learners keep theirs. With equal samples that is the
    plain mean of all learners."""
    m, d = 4, 3
    n = m**d
    algo = Moshpit(sync_every=1, group_size=m, grid_dims=d)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, 50)) + 3.0
    samples = np.full(n, 32, dtype=np.int64) if equal else rng.integers(1, 1000, n)
    w = samples / samples.sum()
    mean = w @ x
    if not equal:  # the weighted mean is not the plain one: the check below tells them apart
        assert np.abs(mean - x.mean(axis=0)).max() > 1e-3
    index = [initial_index(slot, m, d) for slot in range(n)]
    initial_spread = float(np.sum((x - mean) ** 2))
    for t in range(1, 3 * d + 1):
        live = rng.random(n) >= 0.3
        assert 2 <= live.sum() < n
        before, index_before = x.copy(), list(index)
        index = averaging.grid_round(x, index, t, live, samples, algo)
        dropped = np.flatnonzero(~live).tolist()
        np.testing.assert_array_equal(x[dropped], before[dropped])  # vectors kept
        assert [index[i] for i in dropped] == [index_before[i] for i in dropped]
        np.testing.assert_allclose(w @ x, mean, rtol=0, atol=1e-12)
    # The rounds did average: the spread fell well below its start.
    assert float(np.sum((x - mean) ** 2)) < 0.1 * initial_spread


@pytest.mark.parametrize(("m", "d"), [(2, 2), (2, 4), (3, 3), (4, 2), (4, 3), (8, 2)])
def test_learners_that_meet_are_apart_the_next_round(m: int, d: int) -> None:
    n = m**d
    ids = [averaging.learner_id(i) for i in range(n)]
    index = [initial_index(slot, m, d) for slot in range(n)]
    assert len(set(index)) == n  # a full grid: one learner per cell
    pairs_checked = 0
    for t in range(1, 2 * d + 1):
        groups: dict[str, list[int]] = {}
        for i in range(n):
            groups.setdefault(group_key(index[i], t), []).append(i)
        assert sorted(len(g) for g in groups.values()) == [m] * (n // m)
        new = list(index)
        for members in groups.values():
            listed = [(ids[i], index[i]) for i in members]
            for i in members:
                new[i] = next_index(index[i], t, listed, ids[i], m)
        for members in groups.values():
            for a, b in itertools.combinations(members, 2):
                assert group_key(new[a], t + 1) != group_key(new[b], t + 1), (t, a, b)
                pairs_checked += 1
        index = new
    assert pairs_checked == 2 * d * (n // m) * m * (m - 1) // 2
