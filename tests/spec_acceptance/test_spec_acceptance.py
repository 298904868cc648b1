"""Spec 004's acceptance snippets, run unchanged as real processes (tests/spec_acceptance/).

Two training processes open the spec's FileMailbox on one shared directory and train with
``gm.Session(model, algorithm=gm.DiLoCo(sync_every=100, fragments=8), mailbox=box)``, 400
and 100 batches, under the default learner ids; a third then runs
``gm.align(model, mailbox=box)``. The run must have committed training rounds to which both
processes contributed, and align must have loaded the newest commit of every fragment.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from gradientmail import wire as p
from tests.thirdparty.spec_file_mailbox import FileMailbox

REPO = Path(__file__).resolve().parents[2]
FRAGMENTS = 8
LIMIT = 150.0  # seconds for each process


def last_json_line(text: str) -> dict[str, Any]:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, text
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def commits(box: FileMailbox) -> dict[int, p.Commit]:
    async def read() -> dict[int, p.Commit]:
        found = {}
        for key in await box.list(p.ROUNDS):
            found[p.parse_round_key(key)] = p.decode_commit(key, await box.get(key))
        return found

    return asyncio.run(read())


def test_two_processes_train_and_a_third_aligns(tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run-1")
    trainers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.spec_acceptance.train", run_dir, str(steps), str(seed)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        for steps, seed in ((400, 1), (100, 2))
    ]
    try:
        outputs = [proc.communicate(timeout=LIMIT)[0] for proc in trainers]
    finally:
        for proc in trainers:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    assert [proc.returncode for proc in trainers] == [0, 0], outputs
    results = [last_json_line(out) for out in outputs]
    assert [r["steps"] for r in results] == [400, 100]
    learners = {r["learner"] for r in results}
    assert len(learners) == 2, "the default learner ids must differ between processes"

    aligner = subprocess.run(
        [sys.executable, "-m", "tests.spec_acceptance.align", run_dir],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert aligner.returncode == 0, aligner.stderr
    aligned = last_json_line(aligner.stdout)

    box = FileMailbox(run_dir)
    committed = commits(box)
    assert sorted(committed)[:FRAGMENTS] == list(range(FRAGMENTS))  # the initial commits
    training = {r: {c.learner for c in commit.contributors} for r, commit in committed.items()}
    training = {r: who for r, who in training.items() if r >= FRAGMENTS}
    # Every fragment trained at least once; both processes contributed, in shared rounds.
    assert {r % FRAGMENTS for r in training} == set(range(FRAGMENTS)), sorted(training)
    assert set().union(*training.values()) == learners
    assert any(who == learners for who in training.values()), training

    # align loaded the newest commit of every fragment, bit for bit.
    newest = [max(r for r in committed if r % FRAGMENTS == f) for f in range(FRAGMENTS)]
    assert aligned["params"] == [committed[r].params for r in newest]
    assert aligned["loss_after"] < aligned["loss_before"]
    # Each process left with the newest commits of the run applied, or older ones if it
    # finished first; never a round that does not exist.
    for result in results:
        assert all(r in committed for r in result["rounds"])
