"""Two learner processes of a trainer callback, forked from the test process (which has
imported the trainer already: each child skips seconds of imports), on a ``file://``
mailbox, each with the environment ``gradientmail run`` gives a node.

A child runs ``body(workdir)`` with its stdout (the progress lines the live table reads)
going to ``workdir/stdout.txt``; what it returns, or the error it raised, is written as
``workdir/result.json``. Every wait is bounded.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gradientmail as gm
from gradientmail.cli._nodes import STEP_RE
from gradientmail.launch.env import NodeEnv
from tests.support.waiting import TEST_TIMEOUT
from tests.training import commits

RUN_LIMIT = max(TEST_TIMEOUT, 150.0)  # seconds for the whole two-process run

Body = Callable[[Path], dict[str, Any]]


@dataclass(frozen=True)
class Learners:
    """What a two-learner run left: the mailbox, each learner's folder, result and output."""

    box: gm.Mailbox
    fragments: int
    workdirs: dict[str, Path]
    results: dict[str, dict[str, Any]]
    stdout: dict[str, str]

    def contributors(self) -> dict[int, tuple[str, ...]]:
        """Training round -> the learners its commit combined."""
        return {
            c.round: tuple(sorted(x.learner for x in c.contributors))
            for c in commits(self.box)
            if c.round >= self.fragments
        }

    def samples(self) -> dict[tuple[str, int], int]:
        """(learner, fragment) -> the samples of all its committed contributions."""
        total: dict[tuple[str, int], int] = defaultdict(int)
        for commit in commits(self.box):
            for contribution in commit.contributors:
                total[contribution.learner, commit.round % self.fragments] += contribution.samples
        return dict(total)

    def progress(self, learner: str) -> list[tuple[int, float]]:
        """The ``step N loss X`` lines of the learner's output, as the live table reads them."""
        found = []
        for line in self.stdout[learner].splitlines():
            match = STEP_RE.search(line)
            if match and line.startswith(f"{learner}:") and match["loss"] is not None:
                found.append((int(match["step"]), float(match["loss"])))
        return found

    def aligned(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The run's newest commits, loaded into ``model``: its state_dict."""
        gm.align(model, mailbox=self.box)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _child(workdir: Path, environ: dict[str, str], body: Body) -> None:
    os.environ.update(environ)
    os.chdir(workdir)
    torch.set_num_threads(1)  # two learners share the machine (docs/training.md)
    with open(workdir / "stdout.txt", "w") as out:
        os.dup2(out.fileno(), 1)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (fd 1, never closed)
        try:
            result = body(workdir)
        except BaseException as exc:
            result = {"error": repr(exc), "trace": traceback.format_exc()}
        sys.stdout.flush()
    (workdir / "result.json").write_text(json.dumps(result))
    os._exit(0)  # no atexit of the parent's (pytest's) in a forked child


def run_two(root: Path, body: Body, **settings: Any) -> Learners:
    """Learners ``{prefix}0`` and ``{prefix}1`` (``settings``: NodeEnv fields; ``prefix``
    the learner ids' stem) of one run, each running ``body``; returns when both ended."""
    prefix = settings.pop("prefix")
    url = (root / "mailbox").as_uri()
    envs = {
        f"{prefix}{i}": NodeEnv(
            mailbox=url,
            learner_id=f"{prefix}{i}",
            node_index=i,
            nodes=2,
            barriers={"start": 2},
            **settings,
        ).to_environ()
        for i in range(2)
    }
    fork = multiprocessing.get_context("fork")
    workdirs, procs = {}, {}
    for learner, environ in envs.items():
        workdirs[learner] = root / learner
        workdirs[learner].mkdir()
        procs[learner] = fork.Process(
            target=_child, args=(workdirs[learner], environ, body), daemon=True
        )
    try:
        for proc in procs.values():
            proc.start()
        for learner, proc in procs.items():
            proc.join(RUN_LIMIT)
            assert proc.exitcode is not None, f"{learner} still runs after {RUN_LIMIT:.0f} s"
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    results, stdout = {}, {}
    for learner, workdir in workdirs.items():
        stdout[learner] = (workdir / "stdout.txt").read_text()
        done = workdir / "result.json"
        results[learner] = json.loads(done.read_text()) if done.exists() else {"error": "died"}
        assert "error" not in results[learner], (learner, results[learner], stdout[learner][-3000:])
    return Learners(gm.open_mailbox(url), settings["fragments"], workdirs, results, stdout)


def check_rounds(run: Learners, samples_per_learner: int) -> None:
    """Both learners committed rounds together, and each one's committed samples are its
    steps', in every fragment (every step contributed exactly once, with the samples the
    callback counted)."""
    rounds = run.contributors()
    both = tuple(sorted(run.workdirs))
    together = [r for r, who in rounds.items() if who == both]
    assert len(together) >= 2, rounds
    expected = {(learner, f): samples_per_learner for learner in both for f in range(run.fragments)}
    assert run.samples() == expected, (run.samples(), rounds)


__all__ = ["RUN_LIMIT", "Learners", "check_rounds", "run_two"]
