"""The README's way, end to end: ``gradientmail run --nodes 4 -- python examples/classify.py``.

Four node processes train a user's own script (a classifier on real text: see
``examples/classify.py``) on tiny settings. Structure only, never timing: every learner
reached its sync points and contributed at every one (none skipped, the tail contributed at
close), and the aligned model, loaded by ``gm.align`` in another process, evaluates to a
finite loss and beats chance. ``examples/classify_check.py`` is the full-size comparison
with a node alone.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.cli.test_cli import cli

ROOT = Path(__file__).resolve().parents[2]
NODES, STEPS, SYNC_EVERY, FRAGMENTS = 4, 80, 10, 2


def test_four_nodes_train_one_model_the_readme_way(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    done = cli(
        "run",
        *("--nodes", str(NODES), "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY)),
        *("--fragments", str(FRAGMENTS), "--round-timeout", "5", "--workdir", workdir),
        *("--no-live", "--", "python", ROOT / "examples" / "classify.py"),
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    url = (workdir / "mailbox").as_uri()

    status = cli("status", url, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    learners = {v["learner"]: v for v in view["learners"]}
    assert sorted(learners) == [f"local-node-{i}" for i in range(NODES)]
    # Each fragment is due every SYNC_EVERY steps, plus close()'s contribution of the tail
    # of any fragment whose last sync point was before the last step.
    due = STEPS // SYNC_EVERY * FRAGMENTS
    for name, learner in learners.items():
        assert learner["steps"] == STEPS, name
        assert due <= learner["sync_points"] <= due + FRAGMENTS, (name, learner)
        assert learner["skipped"] == 0, (name, learner)
        assert learner["contributed"] == learner["sync_points"], (name, learner)
    assert view["sync"]["skipped"] == 0
    assert view["rounds_committed"] >= due

    evaluated = subprocess.run(
        [sys.executable, "examples/classify.py", "--evaluate", "--aligned", url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert evaluated.returncode == 0, evaluated.stderr
    scores = {row["model"]: row for row in map(json.loads, evaluated.stdout.splitlines())}
    aligned, chance = scores["aligned"], scores["chance"]
    assert math.isfinite(aligned["loss"]), scores
    assert math.isfinite(aligned["accuracy"]), scores
    assert aligned["accuracy"] > chance["accuracy"], scores
    assert aligned["loss"] < chance["loss"], scores
