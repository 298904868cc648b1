"""Runs with real processes: examples/synthetic.py's node and checker roles, on one mailbox.

- spec 004's setup, over a file mailbox and over each S3 server of
  ``GRADIENTMAIL_S3_ENDPOINT`` (the spec's end-to-end check, kept on every store): nodes
  of 400 and 100 steps commit >= 30 training rounds (one at least for each sync point of
  the longer node, every step of both in a commit), every one of them with both nodes
  while both train; a checker recomputes every commit as it lands, and ``gm.align`` in that
  third process loads the newest commit of each fragment;

and over a file mailbox only (see :func:`file_store` for why one store is enough):

- SparseLoCo's compressed contributions: every commit recomputes in the checker;
- a learner killed with SIGKILL: the survivor goes on committing rounds alone, and the
  victim's lease lapses;
- a late joiner: it starts from the newest commits and then contributes to later rounds.

Waits are bounded by ``wait_until`` (``GRADIENTMAIL_TEST_TIMEOUT``) and subprocess timeouts,
and children are killed in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import torch
from safetensors.torch import load_file

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms import from_manifest
from gradientmail.engine.chain import commit_tensors
from gradientmail.inspect import LearnerView, RunWatcher
from gradientmail.payload import get_tensors
from testbed.s3env import S3Target, remove_prefix, s3_targets
from tests.support.waiting import TEST_TIMEOUT, wait_until
from tests.training import sync_points

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "synthetic.py"
FRAGMENTS = 4
SYNC_EVERY = 12
LEASE_TIMEOUT = 2.0
RUN_LIMIT = 150.0  # seconds for one whole examples/synthetic.py run
LONG = 100_000  # steps of a node that runs until the test kills it
# Bound on a node process's start (importing torch, joining, the start barrier): not what
# these tests check, and on a loaded machine (load 20 on 2 cores) two nodes' start-up took
# longer than GRADIENTMAIL_TEST_TIMEOUT's 30 s, failing the test before it began.
STARTUP_LIMIT = max(TEST_TIMEOUT, 120.0)

S3_TARGETS = s3_targets()


@dataclass(frozen=True)
class Store:
    name: str
    url: str

    def open(self) -> gm.Mailbox:
        return gm.open_mailbox(self.url)


@pytest.fixture(params=["filesystem", *(f"s3-{t.name}" for t in S3_TARGETS)])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, s3_buckets: list[S3Target]
) -> Iterator[Store]:
    if request.param == "filesystem":
        yield Store("filesystem", (tmp_path / "mailbox").as_uri())
        return
    target = next(t for t in s3_buckets if f"s3-{t.name}" == request.param)
    prefix = f"test-processes-{uuid.uuid4().hex[:12]}"
    try:
        yield Store(request.param, target.mailbox(prefix).url)
    finally:
        remove_prefix(target, prefix)


@pytest.fixture
def file_store(tmp_path: Path) -> Store:
    """A file mailbox, for the multi-process checks whose store does not change what they
    test: what they check (top-k payloads and their chains, a lease that lapses, a join at
    the newest commits) is the protocol's, built on the mailbox contract alone, and
    tests/mailbox/test_mailbox_contract.py checks that contract on every store (S3's
    listings, create-once writes and deletes included). Each S3 store also trains real node
    processes above, in spec 004's setup; running these three again per store only repeated
    minutes of process start-up and training on two cores."""
    return Store("filesystem", (tmp_path / "mailbox").as_uri())


# -- reading the run from the test process ---------------------------------------------------


@dataclass
class Rounds:
    """The commits of a run, read incrementally (records are never deleted)."""

    box: gm.Mailbox
    commits: dict[int, p.Commit] = field(default_factory=dict)

    def refresh(self) -> dict[int, p.Commit]:
        async def read() -> None:
            for key in await self.box.list(p.ROUNDS):
                r = p.parse_round_key(key)
                if r not in self.commits:
                    self.commits[r] = p.decode_commit(key, await self.box.get(key))

        asyncio.run(read())
        return self.commits

    def training(self) -> dict[int, tuple[str, ...]]:
        """Training round -> its contributors, as of the last refresh."""
        return {
            r: tuple(c.learner for c in commit.contributors)
            for r, commit in sorted(self.commits.items())
            if r >= FRAGMENTS
        }

    def newest(self) -> list[int]:
        self.refresh()
        return [max(r for r in self.commits if r % FRAGMENTS == f) for f in range(FRAGMENTS)]


# -- node processes --------------------------------------------------------------------------


class Node:
    """``examples/synthetic.py --role node``; its JSON lines are collected by a thread."""

    def __init__(
        self, store: Store, index: int, *, steps: int, parties: int, delay: float = 0.02
    ) -> None:
        self.learner = f"node-{index}"
        argv = [
            sys.executable,
            str(SCRIPT),
            "--role=node",
            f"--mailbox={store.url}",
            "--nodes=2",
            f"--index={index}",
            f"--steps={steps}",
            f"--step-delay={delay}",
            f"--parties={parties}",
            f"--sync-every={SYNC_EVERY}",
            f"--fragments={FRAGMENTS}",
            f"--lease-timeout={LEASE_TIMEOUT}",
            "--round-timeout=3",
            "--poll-interval=0.05",
            f"--timeout={STARTUP_LIMIT}",  # the start barrier's bound
        ]
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            with contextlib.suppress(json.JSONDecodeError), self._lock:
                self.records.append(json.loads(line))

    def record(self, event: str) -> dict[str, Any] | None:
        with self._lock:
            return next((r for r in self.records if r.get("event") == event), None)

    def wait_for(self, event: str, timeout: float = TEST_TIMEOUT) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            if self.proc.poll() is not None and self.record(event) is None:
                raise AssertionError(
                    f"{self.learner} exited ({self.proc.returncode}) before {event}"
                )
            return self.record(event)

        return wait_until(found, f"{self.learner}: {event}", timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def killing(*nodes: Node) -> Iterator[None]:
    try:
        yield
    finally:
        for node in nodes:
            node.kill()


# -- a. spec 004's end-to-end check ----------------------------------------------------------


def run_synthetic(store: Store, tmp_path: Path, *options: str) -> tuple[dict[str, Any], Path]:
    """examples/synthetic.py's whole run (2 nodes, a checker): its summary, and the file of
    the parameters ``gm.align`` loaded in the checker."""
    result_path, aligned_path = tmp_path / "result.json", tmp_path / "aligned.safetensors"
    argv = [
        sys.executable,
        str(SCRIPT),
        f"--mailbox={store.url}",
        "--nodes=2",
        f"--sync-every={SYNC_EVERY}",
        f"--fragments={FRAGMENTS}",
        # While both nodes train, a round waits for both (it closes early once both
        # contributed, so this is a bound only a failure reaches), and a live node is never
        # judged gone: every round of that span holds both, however loaded the machine.
        f"--round-timeout={TEST_TIMEOUT}",
        f"--lease-timeout={TEST_TIMEOUT}",
        # The checker verifies every commit as it lands: nothing is swept under it however
        # far behind it falls (sweeping is tested in test_session.py).
        "--keep-rounds=100000",
        f"--timeout={RUN_LIMIT}",
        f"--result={result_path}",
        f"--aligned={aligned_path}",
        *options,
    ]
    run = subprocess.run(
        argv, cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=RUN_LIMIT + 30,
    )  # fmt: skip
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    summary = json.loads(result_path.read_text())
    assert summary["ok"], summary["failures"]
    return summary, aligned_path


def test_spec_setup_commits_verified_rounds_and_align_loads_the_newest(
    store: Store, tmp_path: Path
) -> None:
    steps, batch = {"node-0": 400, "node-1": 100}, 32
    schedule = sync_points(gm.DiLoCo(sync_every=SYNC_EVERY, fragments=FRAGMENTS), 400)
    summary, aligned_path = run_synthetic(
        store,
        tmp_path,
        f"--steps={steps['node-0']},{steps['node-1']}",
        f"--batch-size={batch}",
        # The script's own count is a floor of 30; the test checks the exact schedule below.
        f"--min-rounds={sum(schedule.values())}",
    )

    # Every commit in the mailbox was seen by the checker, and each one recomputed to the
    # same bytes as the closer's.
    rounds = Rounds(store.open())
    committed = rounds.refresh()
    checked = {c["round"]: c for c in summary["commits"]}
    assert sorted(checked) == sorted(committed)
    assert all(c["ok"] for c in checked.values())
    assert summary["verified"] == len(committed)

    training = rounds.training()
    assert sorted(training) == list(range(FRAGMENTS, max(training) + 1)), training
    # Every sync point of node-0 (400 steps) hands a contribution over to a round of its
    # own and waits for that round's commit: at least one round per sync point.
    assert len(training) >= sum(schedule.values()), training
    # Both start together (a start barrier), and a round waits for every live node: every
    # round up to node-1's last holds both; after it, node-0 goes on alone.
    both = [r for r, who in training.items() if set(who) == {"node-0", "node-1"}]
    assert both == list(range(FRAGMENTS, max(both) + 1)), training
    assert all(who == ("node-0",) for r, who in training.items() if r > max(both)), training
    for r, who in training.items():
        assert checked[r]["contributors"] == list(who)
        assert checked[r]["samples"] == committed[r].samples
    # Every step of both nodes is in exactly one commit of each fragment.
    assert {name: node["done"]["steps"] for name, node in summary["nodes"].items()} == steps
    for f in range(FRAGMENTS):
        samples = sum(committed[r].samples for r in training if r % FRAGMENTS == f)
        assert samples == sum(steps.values()) * batch, f

    # align, in the checker, loaded the newest commit of every fragment, bit for bit.
    newest = rounds.newest()
    assert summary["align"]["rounds"] == {str(f): r for f, r in enumerate(newest)}
    aligned = load_file(aligned_path)
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(rounds.box.get(p.MANIFEST)))
    assert manifest.num_fragments == FRAGMENTS
    for f, r in enumerate(newest):
        params = asyncio.run(get_tensors(rounds.box, committed[r].params, manifest.fragments[f]))
        for name, tensor in params.items():
            assert torch.equal(aligned[name], tensor), (f, r, name)
    assert summary["aligned_loss"] < summary["fresh_loss"]


def test_sparseloco_processes_commit_verified_rounds_that_align_loads(
    file_store: Store, tmp_path: Path
) -> None:
    """SparseLoCo's compressed contributions over real processes, parameters stored every
    third round: every commit recomputes bit for bit in the checker (decoding the top-k
    payloads as the closer did, and computing unstored bases along their chains), and
    ``gm.align`` loads exactly the newest commits, which beat a fresh model."""
    summary, aligned_path = run_synthetic(
        file_store,
        tmp_path,
        "--steps=96,48",
        "--algorithm=sparseloco",
        "--compression=topk:0.1:2",
        "--dense-every=3",  # most commits' parameters are computed, not stored
        "--min-rounds=8",  # node-0's sync points: 96 steps / 12 per fragment, 4 fragments
    )
    rounds = Rounds(file_store.open())
    committed = rounds.refresh()
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(rounds.box.get(p.MANIFEST)))
    assert manifest.algorithm["name"] == "sparseloco"
    assert manifest.algorithm["compression"]["density"] == 0.1
    assert {c.stored for c in committed.values()} == {True, False}
    assert summary["verified"] == len(committed)
    assert all(c["ok"] for c in summary["commits"])
    # The contributions are top-k payloads, not parameters: one of them, decoded.
    newest = rounds.newest()
    sample = committed[newest[0]].contributors[0].payload
    stored = asyncio.run(get_tensors(rounds.box, sample))
    assert stored
    assert all("#" in name for name in stored), sorted(stored)[:4]
    aligned = load_file(aligned_path)
    algorithm = from_manifest(manifest.algorithm)
    for f, r in enumerate(newest):
        specs = manifest.fragments[f]
        params = asyncio.run(commit_tensors(rounds.box, algorithm, specs, committed[r]))
        for name, tensor in params.items():
            assert torch.equal(aligned[name], tensor), (f, r, name)
    assert summary["aligned_loss"] < summary["fresh_loss"]


# -- b. a learner killed mid-run -------------------------------------------------------------


def watch(watcher: RunWatcher) -> dict[str, LearnerView]:
    view = asyncio.run(watcher.poll())
    return {learner.learner: learner for learner in view.learners}


class StepClock:
    """The test watcher's clock: it moves only when the test moves it, so a lease lapses in
    the watcher's view exactly when the test says, whatever the delays on a loaded machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_killed_learner_lease_lapses_and_the_survivor_goes_on(file_store: Store) -> None:
    survivor = Node(file_store, 0, steps=LONG, parties=2)
    victim = Node(file_store, 1, steps=LONG, parties=2)
    with killing(survivor, victim):
        box = file_store.open()
        rounds = Rounds(box)
        clock = StepClock()
        watcher = RunWatcher(box, lease_timeout=LEASE_TIMEOUT, clock=clock)
        survivor.wait_for("started", STARTUP_LIMIT)
        victim.wait_for("started", STARTUP_LIMIT)

        def shared() -> int:
            rounds.refresh()
            return sum(len(who) == 2 for who in rounds.training().values())

        wait_until(lambda: shared() >= 3, "three rounds with both nodes")
        assert wait_until(lambda: watch(watcher).get("node-1"), "node-1's lease").live

        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        last_before = max(rounds.refresh())
        # Dead, but not gone: it did not leave, so only its lease can lapse, and it has
        # not yet on the watcher's clock (its newest beat is seen at this clock reading).
        assert watch(watcher)["node-1"].live
        clock.now += 0.9 * LEASE_TIMEOUT
        assert watch(watcher)["node-1"].live, "the lease lapsed before lease_timeout"

        def alone_after_kill() -> list[int]:
            rounds.refresh()
            return [
                r for r, who in rounds.training().items() if r > last_before and who == ("node-0",)
            ]

        # The survivor keeps committing: several new rounds, with itself alone.
        wait_until(lambda: len(alone_after_kill()) >= FRAGMENTS, "rounds by the survivor")

        # The victim's lease lapses once lease_timeout passed without a new beat: not live,
        # and not a clean leave.
        clock.now += 0.2 * LEASE_TIMEOUT
        lapsed = watch(watcher)["node-1"]
        assert not lapsed.live
        assert not lapsed.leaving
        # The survivor's next beat makes it live again on the same clock; the victim's
        # lease stays lapsed.
        views = wait_until(
            lambda: (v := watch(watcher))["node-0"].live and v, "a new beat of the survivor"
        )
        assert not views["node-1"].live
        assert survivor.proc.poll() is None, "the survivor stopped"
        assert victim.record("done") is None


# -- c. a late joiner ------------------------------------------------------------------------


def test_late_joiner_starts_from_the_newest_commits_and_contributes(file_store: Store) -> None:
    first = Node(file_store, 0, steps=LONG, parties=1)
    with killing(first):
        box = file_store.open()
        rounds = Rounds(box)
        first.wait_for("started", STARTUP_LIMIT)
        wait_until(lambda: len(rounds.refresh()) >= 3 * FRAGMENTS, "rounds by the first node")
        before = rounds.newest()

        late = Node(file_store, 1, steps=LONG, parties=1)
        with killing(late):
            joined = late.wait_for("joined", STARTUP_LIMIT)
            after = rounds.newest()
            assert not joined["creator"]
            for f in range(FRAGMENTS):
                r = joined["rounds"][f]
                assert r % FRAGMENTS == f
                assert before[f] <= r <= after[f], (f, before, joined["rounds"], after)
                # Its model holds exactly the parameters of those commits.
                assert joined["params"][f] == rounds.commits[r].params, f
            event = late.wait_for("joined-event")
            assert event["rounds"] == joined["rounds"]

            # It then contributes to rounds after the ones it joined at, with the first node.
            def contributed() -> list[int]:
                rounds.refresh()
                return [
                    r
                    for r, who in rounds.training().items()
                    if r > max(joined["rounds"]) and "node-1" in who
                ]

            wait_until(lambda: len(contributed()) >= FRAGMENTS, "rounds with the late joiner")
            wait_until(
                lambda: any(
                    set(rounds.training()[r]) == {"node-0", "node-1"} for r in contributed()
                ),
                "a round with both nodes",
            )
            assert late.proc.poll() is None
            assert first.proc.poll() is None
