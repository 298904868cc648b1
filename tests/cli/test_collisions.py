"""Runs that cannot collide: a learner id is one process at a time.

- ``gradientmail run`` refuses a mailbox where learners of the same ids are live (another
  ``gradientmail run``), unless ``--join`` adds its nodes as new learners;
- it refuses a run whose spec or model layout differs from the mailbox's, before any node
  starts, with one error listing the differences;
- its run.yaml records the command the user typed;
- ``Session`` refuses a learner id another Session is beating as, and resumes one whose
  earlier life stopped beating without leaving (a crash, a kill).

Liveness is judged by watching beats advance (``coord.leases.beating``); the unit tests
drive it with an injected clock, the others wait for conditions with a bound, never for time.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.cli.run import COMMAND_ANNOTATION
from gradientmail.coord.leases import WATCH_BEATS, beating
from gradientmail.errors import ProtocolError
from tests.cli.test_cli import cli
from tests.cli.test_cli_run import groups_gone, kill_groups, node_pgids
from tests.support.waiting import TEST_TIMEOUT, wait_until

ALGORITHM = gm.DiLoCo(sync_every=10, fragments=2)
QUICK = ("--sync-every", "10", "--fragments", "2", "--round-timeout", "2")


@pytest.fixture(autouse=True)
def _synthetic_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in node trains its synthetic task here (seconds, not the language model's
    minute): these tests are about runs that collide; ``test_demo_lm.py`` runs the model."""
    monkeypatch.setenv("GRADIENTMAIL_TASK", "synthetic")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


async def _put_beat(box: gm.Mailbox, learner: str, number: int, leaving: bool = False) -> None:
    record = p.encode(p.Beat(learner, 0, 0, leaving))
    await box.put_if_absent(f"{p.lease_prefix(learner)}{number:010d}", record)


def _beat(box: gm.Mailbox, learner: str, number: int, leaving: bool = False) -> None:
    asyncio.run(_put_beat(box, learner, number, leaving))


def _beats(box: gm.Mailbox, learner: str) -> list[int]:
    keys = asyncio.run(box.list(p.lease_prefix(learner)))
    return sorted(p.parse_beat_key(k)[1] for k in keys)


# -- watching beats, on an injected clock ---------------------------------------------------


class FakeTime:
    """A clock that only moves when the code under test sleeps; ``during_sleep`` runs at
    each sleep (another process writing beats meanwhile)."""

    def __init__(self, during_sleep: Callable[[], Awaitable[None]] | None = None) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.during_sleep = during_sleep

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.during_sleep is not None:
            await self.during_sleep()


def test_beats_that_advance_are_live_and_beats_that_stand_still_are_not() -> None:
    box = gm.MemoryMailbox()
    for learner in ("crashed", "beating", "left"):
        _beat(box, learner, 3)
    _beat(box, "left", p.LEAVING_BEAT, leaving=True)
    numbers = iter(range(4, 1000))

    async def other_process() -> None:
        await _put_beat(box, "beating", next(numbers))

    fake = FakeTime(other_process)
    found = asyncio.run(
        beating(
            box,
            ["crashed", "beating", "left", "never-seen"],
            5.0,
            clock=fake.clock,
            sleep=fake.sleep,
        )
    )
    assert set(found) == {"beating"}
    assert found["beating"].beat > 3
    assert "beating (beat " in found["beating"].describe()
    # "crashed" was watched for the whole window: 1.5 beat intervals of its clock.
    assert fake.now >= WATCH_BEATS * 5.0


def test_nothing_to_watch_costs_one_listing_and_no_wait() -> None:
    box = gm.MemoryMailbox()
    _beat(box, "left", 7)
    _beat(box, "left", p.LEAVING_BEAT, leaving=True)
    fake = FakeTime()
    assert asyncio.run(beating(box, ["left", "new"], 5.0, clock=fake.clock, sleep=fake.sleep)) == {}
    assert fake.sleeps == 0


def test_a_live_learner_ends_the_watch_early() -> None:
    box = gm.MemoryMailbox()
    _beat(box, "a", 0)
    fake = FakeTime(lambda: _put_beat(box, "a", 1))
    found = asyncio.run(beating(box, ["a"], 5.0, clock=fake.clock, sleep=fake.sleep))
    assert set(found) == {"a"}
    assert found["a"].beat == 1
    assert fake.sleeps == 1


# -- Session -------------------------------------------------------------------------------


def test_a_session_refuses_a_learner_id_live_in_another_session() -> None:
    box = gm.MemoryMailbox()
    # Beats every 0.2 s; the newcomer watches for up to 1.5 × 10 s and stops at the first
    # beat it sees advance (no wait on time: a bounded one).
    with gm.Session(
        _model(), algorithm=ALGORITHM, mailbox=box, learner_id="a", lease_timeout=0.6
    ) as first:
        with pytest.raises(ProtocolError, match=r"learner a is already live .* s ago"):
            gm.Session(
                _model(),
                algorithm=ALGORITHM,
                mailbox=box,
                learner_id="a",
                lease_timeout=30.0,
                join_timeout=60,
            )
        # The refused one wrote nothing: the first goes on and leaves cleanly.
        first.step()
    assert _beats(box, "a")[-1] == p.LEAVING_BEAT


def test_a_session_restarted_after_a_crash_rejoins_as_the_same_learner() -> None:
    box = gm.MemoryMailbox()
    with gm.Session(_model(), algorithm=ALGORITHM, mailbox=box, learner_id="creator"):
        pass
    # An earlier life of "a" that died without leaving: beats that stopped advancing.
    for number in (5, 6):
        _beat(box, "a", number)
    assert _beats(box, "a") == [5, 6]
    with gm.Session(
        _model(), algorithm=ALGORITHM, mailbox=box, learner_id="a", lease_timeout=0.6
    ) as again:
        # It continues its own beat numbers: the earlier life's newest is the only one kept.
        assert min(_beats(box, "a")) >= 6
        assert max(_beats(box, "a")) > 6
        again.step()
    assert _beats(box, "a")[-1] == p.LEAVING_BEAT


def test_a_session_abandoned_without_leaving_is_rejoined() -> None:
    """A real earlier life whose threads stopped (killed) before its leaving beat."""
    box = gm.MemoryMailbox()
    dead = gm.Session(_model(), algorithm=ALGORITHM, mailbox=box, learner_id="a", lease_timeout=0.6)
    dead._shared.stop.set()  # what a SIGKILL leaves: no more beats, no leaving beat
    for thread in dead._threads:
        thread.join(timeout=TEST_TIMEOUT)
    before = _beats(box, "a")
    assert before
    assert before[-1] != p.LEAVING_BEAT
    with gm.Session(_model(), algorithm=ALGORITHM, mailbox=box, learner_id="a", lease_timeout=0.6):
        assert max(_beats(box, "a")) > before[-1]


# -- gradientmail run ------------------------------------------------------------------------


@contextlib.contextmanager
def running(*args: str | Path, workdir: Path) -> Iterator[subprocess.Popen[str]]:
    """A ``gradientmail run`` in the background, stopped (and every node with it) at the end."""
    command = [sys.executable, "-m", "gradientmail.cli", "run", *map(str, args)]
    log = (workdir.parent / f"{workdir.name}.out").open("w")
    proc = subprocess.Popen(
        [*command, "--workdir", str(workdir), "--no-live", "--stop-timeout", "3"],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if (workdir / "nodes.json").exists():
                kill_groups(node_pgids(workdir))
                wait_until(lambda: groups_gone(workdir), "the nodes to be gone")
            log.close()


def _training(workdir: Path, learner: str) -> bool:
    log = workdir / "logs" / f"{learner}.log"
    return log.exists() and f"{learner}: joined, training" in log.read_text()


def test_a_second_run_on_a_live_mailbox_is_refused_unless_it_joins(tmp_path: Path) -> None:
    box_dir = tmp_path / "box"
    url = box_dir.as_uri()
    first = tmp_path / "first"
    with running("--nodes", "2", "--steps", "10000000", *QUICK, "--mailbox", url, workdir=first):
        for learner in ("local-node-0", "local-node-1"):
            wait_until(partial(_training, first, learner), f"{learner} to train", timeout=120)
        # The same ids, the same mailbox: refused, naming them and their beats' age,
        # before any node starts.
        second = tmp_path / "second"
        refused = cli(
            "run", "--nodes", "2", "--steps", "20", *QUICK, "--mailbox", url,
            "--workdir", second, "--no-live", timeout=120,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stdout + refused.stderr
        error = refused.stderr.strip()
        assert error.startswith("gradientmail run: the mailbox holds a run whose learners"), error
        assert len(error.splitlines()) == 1, error
        assert "Traceback" not in refused.stdout + refused.stderr
        for learner in ("local-node-0", "local-node-1"):
            assert f"{learner} (beat " in error
        assert " s ago" in error
        assert "--join" in error
        assert not (second / "nodes.json").exists()
        # --join: the nodes join the run as new learners and finish their steps.
        third = tmp_path / "third"
        joined = cli(
            "run", "--join", "--nodes", "1", "--steps", "20", *QUICK, "--mailbox", url,
            "--workdir", third, "--no-live", timeout=240,
        )  # fmt: skip
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert "local-node-2: step 20 loss" in joined.stdout
        assert (third / "logs" / "local-node-2.log").exists()
        assert "the nodes join it as local-node-2" in joined.stdout
        assert not (third / "logs" / "local-node-0.log").exists()


def test_a_run_that_does_not_match_the_mailbox_is_refused_before_any_node_starts(
    tmp_path: Path,
) -> None:
    url = (tmp_path / "box").as_uri()
    done = cli(
        "run", "--nodes", "1", "--steps", "20", *QUICK, "--mailbox", url,
        "--workdir", tmp_path / "first", timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    other = tmp_path / "other"
    refused = cli(
        "run", "--nodes", "1", "--steps", "20", "--sync-every", "5", "--fragments", "1",
        "--mailbox", url, "--workdir", other, timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.count("gradientmail run:") == 1, refused.stderr
    assert "Traceback" not in refused.stdout + refused.stderr
    assert "do not match" in refused.stderr
    assert "algorithm sync_every: run has 10, these nodes have 5" in refused.stderr
    assert "algorithm fragments: run has 2, these nodes have 1" in refused.stderr
    assert not (other / "nodes.json").exists()
    # A command of one's own: its model is its own business, the algorithm is checked.
    mine = cli(
        "run", "--nodes", "1", "--sync-every", "5", "--mailbox", url,
        "--workdir", tmp_path / "mine", "--", "python", "-c", "pass", timeout=120,
    )  # fmt: skip
    assert mine.returncode == 2, mine.stdout + mine.stderr
    assert "algorithm sync_every: run has 10, these nodes have 5" in mine.stderr
    assert not (tmp_path / "mine" / "nodes.json").exists()
    # The same settings against the finished run (its learners left): it runs again, and
    # its learner resumes where it stopped (optimizer state and step count), training on.
    again = cli(
        "run", "--nodes", "1", "--steps", "30", *QUICK, "--mailbox", url,
        "--workdir", tmp_path / "again", timeout=180,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    assert "local-node-0: joined, resumed at step 20, training to step 30" in again.stdout
    assert "local-node-0: step 30 loss" in again.stdout


def test_run_yaml_records_the_command_the_user_typed(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    words = ["run", "--nodes", "1", "--steps", "5", "--workdir", str(workdir)]
    words += ["--", "python", "-c", "print('hello')"]
    done = cli(*words, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (workdir / "run.yaml").read_text()
    typed = shlex.join(["gradientmail", *words])
    assert text.splitlines()[0] == f"# written by: {typed}"
    resource = yaml.safe_load(text)
    assert resource["metadata"]["annotations"][COMMAND_ANNOTATION] == typed
    template = resource["spec"]["template"]
    assert template["command"] == ["python", "-c", "print('hello')"]
    assert template["args"] == []
    assert "gradientmail.demo.node" not in text
    # The file is a spec `gradientmail run -f` takes, and it runs the same command.
    replay = cli("run", "-f", workdir / "run.yaml", "--workdir", tmp_path / "replay", timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "hello" in (tmp_path / "replay" / "logs" / "local-node-0.log").read_text()


def test_join_needs_the_mailbox_of_a_run(tmp_path: Path) -> None:
    refused = cli("run", "--join", "--workdir", tmp_path / "w")
    assert refused.returncode == 2
    assert "--join: give the --mailbox URL of the run to join" in refused.stderr
    assert not (tmp_path / "w").exists()
