"""The Moshpit benchmark against hivemind (``bench/moshpit_hivemind.py``): GradientMail's side
averages exactly on a full grid, the table renders, and hivemind's side is either measured
or reported not measured with the reason (hivemind is optional: it lives in a venv of its
own, ``bench/hivemind_setup.py``, that CI does not create)."""

from __future__ import annotations

import math
from pathlib import Path

from bench import moshpit_hivemind as mh
from bench._hivemind_moshpit_worker import _bits
from bench.hivemind_setup import Unavailable, locate


def test_gradientmail_averages_exactly_after_d_rounds(tmp_path: Path) -> None:
    # N = 4 learners on a 2 x 2 grid (threads: four processes importing torch would take
    # most of the test's time), each starting at float(i): d = 2 group rounds give every
    # one the global mean 1.5, exactly (pairwise means of small integers).
    config = mh.GMConfig(
        peers=4, group_size=2, params=1000, rounds=2, round_timeout=30.0, processes=False
    )
    assert config.dims == 2
    result = mh.gradientmail_side(config, tmp_path)
    assert result.error == "", result.error
    assert result.calls == 4 * 2
    assert len(result.step_s) == 8
    assert all(s > 0 for s in result.step_s)
    assert result.failed == 0, result.notes
    assert result.spread_d < 1e-12
    assert result.spread_k == result.spread_d  # K = d
    text = mh.render([result])
    assert "| GradientMail | 4" in text
    assert "threads" in text
    assert not list(tmp_path.glob("gm-mailbox-*"))  # the mailbox directory is removed


def test_one_round_halves_the_spread_of_a_pair_line(tmp_path: Path) -> None:
    # After round 1 alone each learner holds the mean of its pair. Which pairs meet is the
    # grid's choice (it depends on the order the learners join), so the invariant is the
    # set of outcomes: the learners start at 0, 1, 2, 3 (spread 5 around 1.5); pairs
    # {0,1}{2,3} leave spread 4 (0.8), {0,2}{1,3} leave 1 (0.2), {0,3}{1,2} leave 0 (each
    # pair's mean is the global one). Anything else is not one round of pair averages.
    config = mh.GMConfig(
        peers=4, group_size=2, params=10, rounds=1, round_timeout=30.0, processes=False
    )
    result = mh.gradientmail_side(config, tmp_path)
    assert result.error == "", result.error
    assert result.failed == 0, result.notes  # every learner met its partner
    assert math.isnan(result.spread_d)  # fewer than d rounds
    pairings = (0.8, 0.2, 0.0)
    assert any(math.isclose(result.spread_k, s, abs_tol=1e-12) for s in pairings), result.spread_k


def test_hivemind_is_measured_or_says_why(tmp_path: Path) -> None:
    try:
        python: Path | None = locate(install=False)
        reason = ""
    except Unavailable as exc:
        python, reason = None, str(exc)
    config = mh.HMConfig(peers=2, group_size=2, params=1000, rounds=1, timeout=20.0)
    result = mh.hivemind_side(config, python, reason, tmp_path)
    text = mh.render([result])
    if result.error:
        assert "not measured" in text
        assert result.error[:60] in text
    else:
        assert result.calls == 2
        assert len(result.step_s) == 2
        assert 0 <= result.failed <= 2
        assert not math.isnan(result.spread_k)
        assert "| hivemind" in text


def test_hivemind_unavailable_still_renders_with_the_reason(tmp_path: Path) -> None:
    config = mh.HMConfig(peers=4, group_size=2, params=10, rounds=2)
    missing = mh.hivemind_side(config, None, "no hivemind venv here", tmp_path)
    assert missing.error == "no hivemind venv here"
    gm_row = mh.Result(
        "GradientMail", 4, 2, 2, 2, "threads", step_s=(0.5, 1.5), calls=2, spread_d=0.0
    )
    text = mh.render([missing, gm_row])
    assert "hivemind at N=4 was not measured: no hivemind venv here" in text
    assert "1.00 s" in text  # the GradientMail row still has its median
    ratio_cell = text.splitlines()[5].split("|")[10].strip()
    assert ratio_cell == "-"  # no hivemind median to compare with


def test_the_ratio_is_gradientmail_over_hivemind() -> None:
    rows = [
        mh.Result("hivemind", 8, 2, 3, 6, "", step_s=(2.0,), calls=1),
        mh.Result("GradientMail", 8, 2, 3, 6, "", step_s=(0.5,), calls=1),
    ]
    assert "0.25x" in mh.render(rows)


def test_hivemind_bits_lay_out_the_grid() -> None:
    # Peers sharing a group key are the lines along dimension 0: pairs (2k, 2k+1) for M=2.
    for n, m, d in ((2, 2, 1), (8, 2, 3), (16, 2, 4), (16, 4, 2)):
        groups: dict[str, list[int]] = {}
        for peer in range(n):
            groups.setdefault(_bits(peer, m, d), []).append(peer)
        assert len(groups) == n // m
        for members in groups.values():
            assert len(members) == m
            assert {p // m for p in members} == {members[0] // m}
        assert all(len(bits) == (d - 1) * (m.bit_length() - 1) for bits in groups)


def test_dims_of_wants_a_full_grid() -> None:
    assert mh.dims_of(16, 2) == 4
    assert mh.dims_of(16, 4) == 2
    assert mh.dims_of(2, 2) == 1
    for peers, size in ((6, 2), (8, 4), (4, 1)):
        try:
            mh.dims_of(peers, size)
        except ValueError:
            continue
        raise AssertionError(f"dims_of({peers}, {size}) accepted a partial grid")
