"""The fault suite: four learner processes train one model while a fault hits the run.

Every case runs on the filesystem mailbox and on SeaweedFS (the server that
``python -m testbed.s3servers`` starts; the case is reported as skipped without it).
The learners are real processes (``tests/support/fault_learner.py``, forked by a fork
server that imported torch once: four fresh interpreters importing torch took 10-20 s a
test on a loaded 2-core machine), each training a tiny MLP with :class:`gm.Session`
(``overlap=0``: every sync point waits for its commit) once all of them joined, with short
timeouts: lease 1.5 s, round 8 s (a live learner slowed by lost responses is waited
for), claim 3 s, a wait at most 30 s; ``keep_rounds`` is large, so no commit is swept
and every one can be recomputed. The faults, one case each:

=====================  ====================================================================
lost-responses         every learner loses the response of 8% of its calls (FaultyMailbox)
killed-learner         a learner is SIGKILLed mid-run
killed-closer          a learner is SIGKILLed between its claim of a round and the commit
                       (its wrapper holds the ``rounds/`` write and says so)
failing-closer         a live learner keeps failing its ``rounds/`` write after its claim
killed-creator-        the creator is SIGKILLed before ``manifest.json`` / after it but
before/after-manifest  before the initial commits (its wrapper holds that write)
store-outage           the store is gone for OUTAGE_S seconds: SeaweedFS is stopped and
                       restarted on the same data and port (a private server); on the
                       filesystem every call fails while a flag file exists
corrupt-payload        one snapshot's payload bytes are overwritten in the store (the sha256
                       in its key no longer matches) before its record is written
truncated-record       a truncated ``rounds/`` record (the first half of a real record's
                       bytes) appears ahead of the run, where every poll lists it
=====================  ====================================================================

For each it asserts, once the run stopped and every survivor closed its session:

- **no lost or mismatched commit**: every fragment's rounds are present in sequence
  (``f, f+P, f+2P, ...``, each built on the one before), every training commit recomputes
  to its record's bytes (:func:`gm.verify.verify_commit`, at the end: nothing was swept),
  every commit a learner reported (``Committed``) or applied (``Applied``) is in the store
  with the same contributors;
- **every sync point contributed** (except across the outage, longer than a wait's
  bound): no survivor skipped one or gave up a wait, and each published as many
  contributions as it reached sync points;
- **identical parameters after align**: every survivor (separate processes) runs
  :func:`gm.align` on a fresh model; all load the same rounds and bit-identical fragments,
  equal to the newest commit of each fragment;
- **progress again**: within PROGRESS_S seconds of the fault's end, every fragment commits
  PROGRESS_COMMITS more rounds and every survivor contributes to one of them (a bounded
  wait for the condition, generous for a loaded CI machine, never a sleep);

plus what the fault itself implies (the failed-over claim, the exclusion, the new creator,
the record reported once). Signals from the learners are stdout lines, never timing
guesses; the one timed wait is the outage's own length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import gradientmail as gm

try:  # the layered tree (wire/), else the flat one (protocol.py) of earlier commits
    from gradientmail import wire as p
except ImportError:
    from gradientmail import protocol as p  # type: ignore[no-redef]
from testbed.s3env import remove_prefix, s3_targets
from testbed.s3servers import DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY, restartable_seaweedfs
from tests.support.waiting import TEST_TIMEOUT, wait_until

REPO = Path(__file__).resolve().parents[2]
FRAGMENTS = 2
LEARNERS = 4
WARMUP_COMMITS = 2 * FRAGMENTS  # training commits before a fault is injected
PROGRESS_COMMITS = 2  # per fragment, after the fault ended
PROGRESS_S = max(60.0, 2 * TEST_TIMEOUT)  # the bound on "progress again"
JOIN_S = max(90.0, 3 * TEST_TIMEOUT)  # four processes importing torch on a loaded machine
# The outage: 30 s on SeaweedFS, as the issue asks (a real server stopped and restarted);
# 10 s on the filesystem, where the flag file makes every call fail at once and the same
# retry path runs (30 s there would only add 20 s of waiting to the suite).
OUTAGE_S = {
    "filesystem": float(os.environ.get("GRADIENTMAIL_FAULT_OUTAGE_FS_S", "10")),
    "seaweedfs": float(os.environ.get("GRADIENTMAIL_FAULT_OUTAGE_S", "30")),
}
LOST_RATE = 0.08

SEAWEEDFS = next((t for t in s3_targets() if t.name == "seaweedfs"), None)


# -- the store -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    name: str  # "filesystem" or "seaweedfs"
    url: str
    env: dict[str, str] = field(default_factory=dict)  # for the learners (credentials)

    def open(self) -> gm.Mailbox:
        return gm.open_mailbox(self.url)


def _file_store(tmp_path: Path) -> Store:
    # No fsync: this suite is about faults of processes and of the store's availability,
    # not about power loss, and fsync made a round 10x slower on a shared CI disk.
    return Store("filesystem", (tmp_path / "mailbox").as_uri() + "?fsync=0")


def _s3_url(endpoint: str, bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}?endpoint={endpoint}"


@pytest.fixture(
    params=[
        "filesystem",
        pytest.param(
            "seaweedfs",
            marks=pytest.mark.skipif(
                SEAWEEDFS is None,
                reason="no seaweedfs entry in GRADIENTMAIL_S3_ENDPOINT: run under "
                "python -m testbed.s3servers",
            ),
        ),
    ]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "filesystem":
        yield _file_store(tmp_path)
        return
    target = SEAWEEDFS
    assert target is not None
    prefix = f"fault-suite-{uuid.uuid4().hex[:12]}"
    try:
        yield Store("seaweedfs", _s3_url(target.endpoint_url, target.bucket, prefix))
    finally:
        with contextlib.suppress(Exception):
            remove_prefix(target, prefix)


# -- learner processes ---------------------------------------------------------------------


class Zygote:
    """``python -m tests.support.fault_learner --serve``: imports torch and the library once,
    then forks each learner on request (a real process with its own pid and process group;
    importing torch took 10-20 s per process on a loaded 2-core CI machine)."""

    def __init__(self, log: Path) -> None:
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fault_learner", "--serve"],
            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log,
        )  # fmt: skip
        self._forked: queue.Queue[int] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(JOIN_S):
            raise AssertionError(f"the fork server did not start:\n{log.read_text()}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record["kind"] == "ready":
                self._ready.set()
            elif record["kind"] == "forked":
                self._forked.put(record["pid"])
            elif record["kind"] == "exit":
                self._exits[record["pid"]] = record["status"]

    def spawn(self, argv: list[str], out: Path, err: Path, env: dict[str, str]) -> int:
        request = {"argv": argv, "out": str(out), "err": str(err), "env": env, "cwd": str(REPO)}
        with self._lock:
            assert self.proc.stdin is not None
            assert self.proc.poll() is None, "the fork server exited"
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            return self._forked.get(timeout=TEST_TIMEOUT)

    def kill(self, pid: int) -> None:
        """SIGKILL learner ``pid`` (the server does it: it knows whether ``pid`` is still its
        child, so a reused pid is never hit)."""
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"kill": pid}) + "\n").encode())
            self.proc.stdin.flush()

    def status(self, pid: int) -> int | None:
        """The exit status of a learner that ended (-9 after SIGKILL), else None."""
        return self._exits.get(pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    server = Zygote(tmp_path_factory.mktemp("fault-suite") / "fork-server.log")
    try:
        yield server
    finally:
        server.close()


class Learner:
    """One learner process (forked by the :class:`Zygote`); its stdout is a file of JSON
    lines, followed by a thread."""

    def __init__(self, run: Run, index: int, extra: tuple[str, ...]) -> None:
        self.name = f"learner-{index}"
        argv = [
            f"--mailbox={run.store.url}",
            f"--learner={self.name}",
            f"--index={index}",
            f"--control={run.control}",
            f"--fragments={FRAGMENTS}",
            f"--join-timeout={JOIN_S}",
            f"--timeout={JOIN_S + 4 * PROGRESS_S + 120}",
            *extra,
        ]
        self.zygote = run.zygote
        self.out = run.tmp / f"{self.name}.out"
        self.log = run.tmp / f"{self.name}.err"
        self.out.touch()
        self.lines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.pid = self.zygote.spawn(argv, self.out, self.log, run.store.env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = ""
        with self.out.open(errors="replace") as out:
            while True:
                ended = not self.alive()  # looked at before the read: nothing is missed
                chunk = out.read()
                buffer += chunk
                *complete, buffer = buffer.split("\n")
                for line in complete:
                    with contextlib.suppress(json.JSONDecodeError), self._lock:
                        self.lines.append(json.loads(line))
                if ended and not chunk:
                    return
                if not chunk:
                    time.sleep(0.02)

    @property
    def returncode(self) -> int | None:
        return self.zygote.status(self.pid)

    def records(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        with self._lock:
            return [
                r
                for r in self.lines
                if r.get("kind") == kind and all(r.get(k) == v for k, v in match.items())
            ]

    def events(self, type_name: str) -> list[dict[str, Any]]:
        return self.records("event", type=type_name)

    def alive(self) -> bool:
        return self.returncode is None

    def wait_for(self, kind: str, timeout: float = TEST_TIMEOUT, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            got = self.records(kind, **match)
            if got:
                return got[0]
            if not self.alive():
                self._reader.join(timeout=5)
                if got := self.records(kind, **match):
                    return got[0]
                raise AssertionError(
                    f"{self.name} exited ({self.returncode}) before {kind!r}:\n{self.tail()}"
                )
            return None

        return wait_until(found, f"{self.name}: {kind} {match or ''}", timeout=timeout)

    def wait(self, timeout: float) -> int:
        def ended() -> tuple[int] | None:
            code = self.returncode
            return None if code is None else (code,)

        return wait_until(ended, f"{self.name} to exit", timeout)[0]

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL it (now, wherever it is) and wait until it ended."""
        if self.alive():
            self.zygote.kill(self.pid)
        with contextlib.suppress(AssertionError):
            self.wait(timeout=10)


class Run:
    """One run of the suite: the store, the control directory, the learners, the commits."""

    def __init__(self, store: Store, tmp: Path, zygote: Zygote) -> None:
        self.store = store
        self.zygote = zygote
        self.tmp = tmp
        self.control = tmp / "control"
        self.control.mkdir(parents=True)
        self.learners: list[Learner] = []
        self.box = store.open()
        self.commits: dict[int, p.Commit] = {}
        self.ignored: set[str] = set()
        self.began = time.monotonic()

    def phase(self, what: str) -> None:
        """Print how long the run took to get here (pytest -s shows it)."""
        print(f"[{time.monotonic() - self.began:6.1f} s] {what}", flush=True)

    def start(self, index: int, *extra: str) -> Learner:
        learner = Learner(self, index, extra)
        self.learners.append(learner)
        return learner

    def touch(self, name: str) -> Path:
        path = self.control / name
        path.touch()
        return path

    def refresh(self) -> dict[int, p.Commit]:
        """Read the round records that appeared since the last call (records are never
        deleted: keep_rounds is large). A record that does not decode fails the test,
        except the keys in :attr:`ignored` (a fault planted them)."""

        async def read() -> None:
            for key in await self.box.list(p.ROUNDS):
                if key in self.ignored:
                    continue
                r = p.parse_round_key(key)
                if r not in self.commits:
                    self.commits[r] = p.decode_commit(key, await self.box.get(key))

        asyncio.run(read())
        return self.commits

    def newest(self) -> int:
        return max(self.refresh(), default=-1)

    def check_alive(self, *expected: Learner) -> None:
        for learner in expected or [x for x in self.learners if not x.records("killed-by-test")]:
            if not learner.alive() and learner.returncode != 0:
                raise AssertionError(
                    f"{learner.name} died ({learner.returncode}):\n{learner.tail()}"
                )

    def kill(self, learner: Learner) -> None:
        with learner._lock:
            learner.lines.append({"kind": "killed-by-test"})
        learner.kill()

    def stop_all(self) -> None:
        for learner in self.learners:
            learner.kill()


@pytest.fixture
def make_run(tmp_path: Path, zygote: Zygote) -> Iterator[Callable[[Store], Run]]:
    runs: list[Run] = []

    def make(store: Store) -> Run:
        run = Run(store, tmp_path / f"run-{len(runs)}", zygote)
        runs.append(run)
        return run

    try:
        yield make
    finally:
        for run in runs:
            run.stop_all()


def start_four(run: Run, extra: dict[int, tuple[str, ...]] | None = None) -> list[Learner]:
    """Four learners, once they all joined and committed WARMUP_COMMITS rounds together."""
    extra = extra or {}
    learners = [run.start(i, f"--parties={LEARNERS}", *extra.get(i, ())) for i in range(LEARNERS)]
    for learner in learners:
        learner.wait_for("joined", timeout=JOIN_S)
    run.phase("all four joined")
    everyone = {learner.name for learner in learners}

    def warm() -> bool:
        run.check_alive()
        together = [
            r
            for r, commit in run.refresh().items()
            if {c.learner for c in commit.contributors} == everyone
        ]
        return len(together) >= WARMUP_COMMITS

    wait_until(warm, "the warm-up commits of all four", timeout=JOIN_S, every=0.1)
    run.phase(f"warmed up: {len(run.commits)} commits")
    return learners


# -- the checks ----------------------------------------------------------------------------


def progress_after(run: Run, after: int, survivors: list[Learner], what: str, since: float) -> None:
    """Progress again: every fragment commits PROGRESS_COMMITS rounds after round ``after``
    and every survivor contributes to one of them, within PROGRESS_S seconds of ``since``
    (``time.monotonic()`` when the fault ended)."""
    names = {learner.name for learner in survivors}

    def done() -> bool:
        run.check_alive(*survivors)
        fresh = {r: c for r, c in run.refresh().items() if r > after}
        per_fragment = [sum(r % FRAGMENTS == f for r in fresh) for f in range(FRAGMENTS)]
        joined_in = {c.learner for commit in fresh.values() for c in commit.contributors}
        return min(per_fragment) >= PROGRESS_COMMITS and names <= joined_in

    left = since + PROGRESS_S - time.monotonic()
    wait_until(done, f"progress after {what} (rounds > {after})", timeout=left, every=0.1)
    run.phase(f"{what}: progress again {time.monotonic() - since:.1f} s after the fault ended")


def remaining(since: float) -> float:
    """What is left of PROGRESS_S since ``since``."""
    return max(1.0, since + PROGRESS_S - time.monotonic())


def verify_all(run: Run) -> dict[int, p.Commit]:
    """No lost or mismatched commit: every fragment's rounds in sequence, each training
    commit recomputed from its record and its base (gm.verify)."""
    commits = run.refresh()
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(run.box.get(p.MANIFEST)))
    assert manifest.num_fragments == FRAGMENTS
    for f in range(FRAGMENTS):
        rounds = sorted(r for r in commits if r % FRAGMENTS == f)
        assert rounds == list(range(f, rounds[-1] + 1, FRAGMENTS)), (f, rounds)
        for r in rounds:
            assert commits[r].fragment == f
            assert commits[r].base == (None if r < FRAGMENTS else r - FRAGMENTS), r

    async def verify() -> list[Any]:
        limit = asyncio.Semaphore(8)

        async def one(r: int) -> Any:
            async with limit:
                return await gm.verify.verify_commit(run.box, r, manifest)

        return await asyncio.gather(*(one(r) for r in sorted(commits)), return_exceptions=True)

    results = asyncio.run(verify())
    failed = {
        r: v for r, v in zip(sorted(commits), results, strict=True) if isinstance(v, Exception)
    }
    assert not failed, f"commits that do not recompute: {failed}"
    for r, verified in zip(sorted(commits), results, strict=True):
        assert verified.round == r
        assert tuple(verified.contributors) == tuple(c.learner for c in commits[r].contributors)
    return commits


def reported_commits_exist(run: Run, commits: dict[int, p.Commit]) -> None:
    """Every commit a learner reported writing or applied is in the store, unchanged."""
    for learner in run.learners:
        for event in learner.events("Committed"):
            r = event["round"]
            assert r in commits, (learner.name, event)
            assert list(event["contributors"]) == [c.learner for c in commits[r].contributors]
        for event in learner.events("Applied"):
            assert event["round"] in commits, (learner.name, event)


def finish(
    run: Run, survivors: list[Learner], *, skips: bool = False, missed: bool = False
) -> dict[int, p.Commit]:
    """Stop the run, check every commit, align in every survivor: identical parameters.

    Unless ``skips`` (a store outage longer than a wait's bound), every sync point of every
    survivor contributed: none was skipped, no wait gave up (``wait_timeout`` is 30 s).
    ``missed``: a round may close without a live learner whose beats the fault delayed past
    its 1.5 s lease (it looked gone for a moment); such a sync point is counted as skipped,
    its steps go into the next contribution, and no wait gives up."""
    run.touch("stop")
    for learner in survivors:
        closed = learner.wait_for("closed", timeout=PROGRESS_S)
        assert closed["error"] is None, (learner.name, closed)
        counters = closed["counters"]
        print(learner.name, "counters:", counters)
        if missed:
            assert counters.get("wait_timeouts", 0) == 0, (learner.name, counters)
            accounted = counters["published"] + counters["skipped_syncs"]
            assert accounted == counters.get("sync_points"), (learner.name, counters)
        elif not skips:
            assert counters["skipped_syncs"] == 0, (learner.name, counters)
            assert counters.get("wait_timeouts", 0) == 0, (learner.name, counters)
            assert counters["published"] == counters.get("sync_points"), (learner.name, counters)
    run.phase("every survivor closed")
    commits = verify_all(run)
    reported_commits_exist(run, commits)
    run.phase(f"{len(commits)} commits verified")
    run.touch("align")
    aligned = [learner.wait_for("aligned", timeout=PROGRESS_S) for learner in survivors]
    newest = {f: max(r for r in commits if r % FRAGMENTS == f) for f in range(FRAGMENTS)}
    for record in aligned:
        assert record["finite"], record
        assert record["rounds"] == {str(f): r for f, r in newest.items()}, record
        assert record["params"] == [commits[newest[f]].params for f in range(FRAGMENTS)], record
    for learner in survivors:
        assert learner.wait(timeout=30) == 0, learner.tail()
    run.phase(f"aligned in {len(survivors)} processes: identical, the newest commits {newest}")
    return commits


# -- the cases -----------------------------------------------------------------------------


def test_lost_responses(store: Store, make_run: Callable[[Store], Run]) -> None:
    """The fault lasts the whole run; progress is counted from the warm-up's end."""
    run = make_run(store)
    learners = start_four(run, {i: (f"--lost-rate={LOST_RATE}",) for i in range(LEARNERS)})
    progress_after(run, run.newest(), learners, "lost responses", time.monotonic())
    finish(run, learners, missed=True)
    lost = [learner.records("closed")[0]["lost"] for learner in learners]
    assert all(n > 0 for n in lost), lost


def test_killed_learner(store: Store, make_run: Callable[[Store], Run]) -> None:
    run = make_run(store)
    learners = start_four(run)
    victim, survivors = learners[-1], learners[:-1]
    run.kill(victim)
    killed = time.monotonic()
    progress_after(run, run.newest(), survivors, "a SIGKILLed learner", killed)
    commits = finish(run, survivors)
    # Its lease lapsed: the newest commits of every fragment go on without it.
    for f in range(FRAGMENTS):
        newest = max(r for r in commits if r % FRAGMENTS == f)
        assert victim.name not in {c.learner for c in commits[newest].contributors}


@pytest.mark.parametrize("mode", ["hold", "fail"], ids=["killed-closer", "failing-closer"])
def test_closer_between_claim_and_commit(
    store: Store, make_run: Callable[[Store], Run], mode: str
) -> None:
    """``hold``: the closer is SIGKILLed while it holds its claim (payloads stored, record
    not written). ``fail``: it stays alive and its record write keeps failing."""
    run = make_run(store)
    learners = start_four(run, {LEARNERS - 1: (f"--closer={mode}",)})
    closer = learners[-1]
    run.touch("arm")
    held = closer.wait_for("hold", timeout=PROGRESS_S)
    r = p.parse_round_key(held["key"])
    run.phase(f"{closer.name} claimed round {r} and holds its record write ({mode})")
    if mode == "hold":
        run.kill(closer)
        survivors = learners[:-1]
    else:
        survivors = learners
    since = time.monotonic()
    # The claim fails over: another learner commits round r on a later attempt.
    wait_until(lambda: r in run.refresh(), f"round {r} to commit", timeout=remaining(since))
    commit = run.commits[r]
    run.phase(f"round {r} committed by {commit.closer}, attempt {commit.attempt}")
    progress_after(run, r, survivors, f"a {mode} closer", since)
    commits = finish(run, survivors)
    assert commits[r].closer != closer.name
    assert commits[r].attempt >= 1
    claims = asyncio.run(run.box.list(p.claims_prefix(r)))
    holder = p.decode_claim(claims[0], asyncio.run(run.box.get(claims[0]))).learner
    assert holder == closer.name, claims


@pytest.mark.parametrize("stage", ["manifest", "initial"])
def test_killed_creator(store: Store, make_run: Callable[[Store], Run], stage: str) -> None:
    """The creator is SIGKILLed at its manifest write, or after the manifest at its first
    initial commit; the other learners, waiting to join, take the run over."""
    run = make_run(store)
    creator = run.start(0, f"--creator={stage}")
    creator.wait_for("hold", timeout=JOIN_S)
    others = [run.start(i, f"--parties={LEARNERS - 1}") for i in range(1, LEARNERS)]
    for learner in others:
        learner.wait_for("starting", timeout=JOIN_S)
    run.kill(creator)
    killed = time.monotonic()
    run.phase(f"the creator was killed at its {stage} write")
    for learner in others:
        learner.wait_for("joined", timeout=remaining(killed))
    run.phase("the three others joined")
    progress_after(run, FRAGMENTS - 1, others, f"a creator killed at its {stage}", killed)
    commits = finish(run, others)
    manifest = p.decode_manifest(p.MANIFEST, asyncio.run(run.box.get(p.MANIFEST)))
    claims = asyncio.run(run.box.list(p.CREATOR))
    holders = [p.decode_creator(k, asyncio.run(run.box.get(k))).learner for k in claims]
    assert holders[0] == creator.name, holders
    if stage == "manifest":
        # The role failed over to a later attempt, whose holder wrote the manifest.
        assert len(holders) >= 2, holders
        assert manifest.creator == holders[-1] != creator.name, (manifest.creator, holders)
    else:
        # The manifest is the dead creator's; a joiner wrote the initial commits.
        assert manifest.creator == creator.name
        for f in range(FRAGMENTS):
            assert commits[f].closer != creator.name


@pytest.mark.slow  # the outage's own length: 30 s on SeaweedFS
def test_store_outage(store: Store, make_run: Callable[[Store], Run], tmp_path: Path) -> None:
    seconds = OUTAGE_S[store.name]
    if store.name == "filesystem":
        run = make_run(store)
        flag = run.control / "outage"
        learners = start_four(run, {i: (f"--outage-flag={flag}",) for i in range(LEARNERS)})
        before = run.newest()
        flag.touch()
        began = time.monotonic()
        pause_until(began + seconds)
        flag.unlink()
        ended = time.monotonic()
        progress_after(run, before, learners, f"a {ended - began:.0f} s outage", ended)
        finish(run, learners, skips=True)
        assert all(x.records("closed")[0]["outage_failures"] > 0 for x in learners)
        return
    # SeaweedFS: a private server, stopped and restarted on the same data dir and port.
    with restartable_seaweedfs(tmp_path / "seaweedfs") as weed:
        server = weed.server
        private = Store(
            "seaweedfs",
            _s3_url(server.endpoint_url, server.bucket, "outage"),
            {
                "AWS_ACCESS_KEY_ID": DEFAULT_ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": DEFAULT_SECRET_KEY,
                "AWS_DEFAULT_REGION": server.region,
            },
        )
        run = make_run(private)
        run.box = server.mailbox("outage")
        learners = start_four(run)
        before = run.newest()
        began = time.monotonic()
        weed.stop()
        pause_until(began + seconds)
        weed.start()
        ended = time.monotonic()
        what = f"a {ended - began:.0f} s SeaweedFS outage"
        progress_after(run, before, learners, what, ended)
        finish(run, learners, skips=True)


def test_corrupt_payload(store: Store, make_run: Callable[[Store], Run]) -> None:
    run = make_run(store)
    learners = start_four(run, {LEARNERS - 1: ("--corrupt",)})
    spoiler = learners[-1]
    run.touch("arm")
    corrupted = spoiler.wait_for("corrupted", timeout=PROGRESS_S)
    since = time.monotonic()
    r = corrupted["round"]
    run.phase(f"{spoiler.name}'s payload for round {r} is corrupt in the store")
    wait_until(lambda: r in run.refresh(), f"round {r} to commit", timeout=remaining(since))
    progress_after(run, r, learners, "a corrupt payload", since)
    commits = finish(run, learners)
    commit = commits[r]
    assert spoiler.name not in {c.learner for c in commit.contributors}
    (excluded,) = [x for x in commit.excluded if x.learner == spoiler.name]
    assert excluded.key == p.snapshot_key(r, spoiler.name)
    assert "Corrupt" in excluded.reason or "sha256" in excluded.reason, excluded.reason


def test_truncated_record(store: Store, make_run: Callable[[Store], Run]) -> None:
    run = make_run(store)
    learners = start_four(run)
    newest = run.newest()
    whole = asyncio.run(run.box.get(p.round_key(newest)))
    assert whole is not None
    # Far ahead of the run, so every poll lists it from now on (and the run never reaches it).
    bad = p.round_key(10**9 + newest % FRAGMENTS)
    run.ignored.add(bad)
    assert asyncio.run(run.box.put_if_absent(bad, whole[: len(whole) // 2]))
    since = time.monotonic()
    run.phase(f"wrote half of {p.round_key(newest)}'s bytes at {bad}")

    def reports(learner: Learner) -> list[int]:
        """The line numbers of the learner's reports naming the bad record."""
        with learner._lock:
            return [
                n
                for n, line in enumerate(learner.lines)
                if line.get("type") == "PollFailed" and bad in line.get("error", "")
            ]

    wait_until(
        lambda: all(reports(x) for x in learners),
        f"every learner to report {bad}",
        timeout=remaining(since),
    )
    seen = run.newest()
    run.phase("every learner's syncer reported it")
    progress_after(run, seen, learners, "a truncated round record", since)

    def applied_since(learner: Learner) -> bool:
        """The learner applied commits of every fragment after it reported the record."""
        first = reports(learner)[0]
        with learner._lock:
            after = [
                line["round"]
                for line in learner.lines[first:]
                if line.get("type") == "Applied" and line["round"] > seen
            ]
        return all(any(r % FRAGMENTS == f for r in after) for f in range(FRAGMENTS))

    wait_until(
        lambda: all(applied_since(x) for x in learners),
        "every learner to apply commits of every fragment after the bad record",
        timeout=remaining(since),
    )
    for learner in learners:
        assert len(reports(learner)) == 1, f"{learner.name} reported {bad} more than once"
    # align (and a joining Session) would read the garbage as a fragment's newest commit
    # and fail (load_newest decodes only the newest record of each fragment): remove it
    # before the align check, as an operator would.
    asyncio.run(run.box.delete([bad]))
    finish(run, learners)


def pause_until(deadline: float) -> None:
    """The fault's own duration (the one wait here that is a span of time, not a signal)."""
    left = deadline - time.monotonic()
    wait_until(lambda: time.monotonic() >= deadline, "the outage", timeout=left + 5, every=0.1)
