"""The ``gradientmail`` command on a run's mailbox: status, align, verify, sweep, rm, and the
errors for bad URLs, unreachable stores, empty and foreign prefixes and bad spec files.

Every command runs against every store the ``mailbox`` fixture provides that another
process can open by URL (file://, and S3 when ``GRADIENTMAIL_S3_ENDPOINT`` is set). In each
test, a command's first run against the directory is a subprocess (``python -m
gradientmail.cli``: :func:`cli`), as users run it; its other runs, and every run against the
other stores, are in this process (``gradientmail.cli.main``: :func:`cli_here`, with the
same exit status, stdout and stderr): see :class:`Commands`. What a process adds (argv,
exit status, stdin, the output streams of a fresh interpreter) is the same whatever the
store and the mailbox's state, so it is checked once per command and test rather than at
every call, and each call does not pay a fresh interpreter importing torch (``verify`` and
``align``: seconds each, more on a busy machine). The ``status --watch`` tests, stopped
with Ctrl-C, run the command as a subprocess against every store.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.cli import main
from gradientmail.cli._common import readable_url
from gradientmail.cli.spec import load_spec
from gradientmail.cli.tools import SWEPT_HINT, _ranges
from tests.conftest import MAILBOXES
from tests.inspect.test_inspect import Run
from tests.training import Learner, commits, make_model, run_learners

TIMEOUT = 120


def cli(
    *args: str | Path, stdin: str | None = None, timeout: float = TIMEOUT, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradientmail.cli", *map(str, args)],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"COLUMNS": "160"} | env,
    )


Completed = subprocess.CompletedProcess[str]


def cli_here(*args: str | Path, stdin: str | None = None, **env: str) -> Completed:
    """What :func:`cli` runs, in this process: ``gradientmail.cli.main`` with this stdin,
    the environment :func:`cli` gives, and stdout and stderr captured (not terminals, as
    under :func:`cli`). The command bounds its own waits on a store (``--store-timeout``)."""
    words = [str(a) for a in args]
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {"COLUMNS": "160"} | env),
        mock.patch.object(sys, "stdin", io.StringIO(stdin or "")),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        status = main(words)
    return subprocess.CompletedProcess(words, status, stdout.getvalue(), stderr.getvalue())


class Commands:
    """``gradientmail`` commands of one test against ``box``: each command's first call
    against the directory store as a subprocess (:func:`cli`), every other call in this
    process (:func:`cli_here`); see the module's docstring."""

    def __init__(self, box: gm.Mailbox) -> None:
        self.processes = isinstance(box, gm.FileMailbox)
        self.started: set[str] = set()  # commands already run as a subprocess

    def __call__(self, *args: str | Path, stdin: str | None = None) -> Completed:
        name = str(args[0])
        if self.processes and name not in self.started:
            self.started.add(name)
            return cli(*args, stdin=stdin)
        return cli_here(*args, stdin=stdin)


# The commands run in another process, which opens the store by URL: the stores that have
# one (memory lives in this process; the spec's third-party class has no URL form).
URL_STORES = [name for name, _ in MAILBOXES if name == "filesystem" or name.startswith("s3-")]


@pytest.fixture(params=URL_STORES)
def mailbox(request: pytest.FixtureRequest, s3_buckets: object) -> Iterator[gm.Mailbox]:
    yield from dict(MAILBOXES)[request.param]()


def url_of(box: gm.Mailbox) -> str:
    assert isinstance(box, gm.FileMailbox | gm.S3Mailbox)
    return box.url


def count(box: gm.Mailbox, prefix: str = "") -> int:
    return len(asyncio.run(box.list(prefix)))


def replace_object(box: gm.Mailbox, key: str, data: bytes) -> None:
    asyncio.run(box.delete([key]))
    assert asyncio.run(box.put_if_absent(key, data))


# Steps each learner of train_run trains: 8 sync points (sync_every 5, 2 fragments), so each
# fragment has up to 4 training commits after its initial one, more than the 2 whose inputs
# a sweep keeps (keep_rounds 2): some commits become unverifiable, and some stay verifiable.
STEPS = 20


def train_run(box: gm.Mailbox, steps: int = STEPS) -> list[p.Commit]:
    """Two learners, two fragments; every object kept (keep_rounds 10,000)."""
    learners = [Learner("alice", steps), Learner("bob", steps, seed=1)]
    run_learners(learners, box, gm.DiLoCo(sync_every=5, fragments=2))
    return commits(box)


def verify_counts(stdout: str) -> tuple[int, int, int, int]:
    """``verify``'s summary: (commits, verified, no longer verifiable, mismatched)."""
    found = re.search(
        r"(\d+) commits: (\d+) verified, (\d+) no longer verifiable, (\d+) mismatched", stdout
    )
    assert found is not None, stdout
    total, verified, unverifiable, mismatched = map(int, found.groups())
    return total, verified, unverifiable, mismatched


def verifiable_after_sweep(
    history: list[p.Commit], fragments: int = 2, keep_rounds: int = 2
) -> set[int]:
    """The rounds a sweep with ``keep_rounds`` leaves verifiable (``tools.SWEPT_HINT``):
    a commit's inputs and its base's are kept while both are among their fragment's
    newest ``keep_rounds`` commits; an initial commit has no base."""
    newest: dict[int, int] = {}
    for c in history:
        newest[c.round % fragments] = max(c.round, newest.get(c.round % fragments, -1))

    def kept(r: int) -> bool:
        return r > newest[r % fragments] - keep_rounds * fragments

    return {
        c.round
        for c in history
        if kept(c.round) and (c.round < fragments or kept(c.round - fragments))
    }


def after_sweep(history: list[p.Commit]) -> tuple[int, int, int, int]:
    """``verify_counts`` after ``sweep`` (keep_rounds 2): every listed commit counted,
    none mismatched, the verifiable ones as :func:`verifiable_after_sweep` says."""
    verified = len(verifiable_after_sweep(history))
    assert verified >= 2  # each fragment's newest commit, at least
    return len(history), verified, len(history) - verified, 0


# -- one run, every command ------------------------------------------------------------------


def test_status_align_verify_sweep_rm(mailbox: gm.Mailbox, tmp_path: Path) -> None:
    url = url_of(mailbox)
    command = Commands(mailbox)
    history = train_run(mailbox)
    training = [c for c in history if c.round >= 2]
    assert len(training) >= 2

    status = command("status", url, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["exists"]
    assert view["fragments"] == 2
    assert view["creator"] in ("alice", "bob")
    assert view["rounds_committed"] == len(training)
    assert view["newest_round"] == max(c.round for c in history)
    assert {v["learner"]: v["steps"] for v in view["learners"]} == {"alice": STEPS, "bob": STEPS}
    for learner in view["learners"]:  # the Session's counters, from its last (leaving) beat
        assert learner["sync_points"] > 0, learner
        assert learner["contributed"] > 0, learner
        # Every sync point is accounted for: contributed, or passed when its round closed
        # without it (round_timeout is 1 s here, and CI machines are slow).
        assert learner["contributed"] + learner["skipped"] == learner["sync_points"], learner
    assert view["sync"]["sync_points"] == sum(v["sync_points"] for v in view["learners"])
    table = command("status", url)
    assert table.returncode == 0, table.stderr
    assert f"rounds committed {len(training)}" in table.stdout
    assert "alice" in table.stdout
    assert "bob" in table.stdout

    target = tmp_path / "out" / "model.safetensors"
    aligned = command("align", url, "--out", target)
    assert aligned.returncode == 0, aligned.stderr
    from safetensors import safe_open

    model = make_model()
    rounds = gm.align(model, mailbox=mailbox)
    with safe_open(str(target), framework="pt") as f:
        assert sorted(f.keys()) == sorted(name for name, _ in model.named_parameters())
        for name, param in model.named_parameters():
            assert f.get_tensor(name).equal(param.detach()), name
        metadata = f.metadata()
    assert json.loads(metadata["gradientmail.rounds"]) == {str(k): v for k, v in rounds.items()}

    # A commit whose parameters are not what its record implies (its base's, unchanged),
    # on the newest round, so that no later commit inherits the mismatch.
    victim = max(history, key=lambda c: c.round)
    base = next(c for c in history if c.round == victim.base)
    key = p.round_key(victim.round)
    original = asyncio.run(mailbox.get(key))
    assert original is not None
    forged = replace(victim, params=base.params)
    replace_object(mailbox, key, p.encode(forged))
    tampered = command("verify", url, "-v")  # every other commit checks out
    assert tampered.returncode == 1
    assert f"{len(history)} commits: {len(history) - 1} verified" in tampered.stdout
    assert f"round {history[-2].round:6d}" in tampered.stdout
    assert "1 mismatched" in tampered.stdout
    assert f"MISMATCH round {victim.round}: {key}: its parameters" in tampered.stderr
    replace_object(mailbox, key, original)

    # What verify advises after a sweep (keep_rounds >= the longest fragment's commits)
    # keeps every commit checkable: a sweep with that many deletes no commit's inputs.
    per_fragment = [sum(1 for c in history if c.round % 2 == f) for f in (0, 1)]
    enough = command("sweep", url, "--keep-rounds", str(max(per_fragment)), "--yes")
    assert enough.returncode == 0, enough.stderr
    assert verify_counts(command("verify", url).stdout) == (len(history), len(history), 0, 0)

    before = count(mailbox)
    refused = command("sweep", url, stdin="n\n")
    assert refused.returncode == 1
    assert "nothing deleted" in refused.stderr
    assert count(mailbox) == before
    swept = command("sweep", url, "--yes")
    assert swept.returncode == 0, swept.stderr
    assert "snapshots" in swept.stdout
    assert "payloads" in swept.stdout
    assert count(mailbox) < before
    assert count(mailbox, p.ROUNDS) == len(history)  # round records stay
    after = command("verify", url)
    assert after.returncode == 0, after.stdout + after.stderr
    # keep_rounds 2: how many commits each fragment has depends on scheduling (a loaded
    # machine skips sync points); what stays verifiable follows from the commits listed.
    assert verify_counts(after.stdout) == after_sweep(history)
    unverifiable = sorted(set(c.round for c in history) - verifiable_after_sweep(history))
    assert f"not verifiable (their inputs were swept): rounds {_ranges(unverifiable)}" in (
        after.stdout
    )
    assert SWEPT_HINT in " ".join(after.stdout.split())
    # It says what is checkable and how to keep every commit so: a run this long needs
    # keep_rounds of its longest fragment's commit count.
    advice = " ".join(after.stdout.split())
    verified = len(verifiable_after_sweep(history))
    assert f"checkable: {verified} of {len(history)} commits" in advice
    assert f"gradientmail verify {shlex.quote(readable_url(url))}` while the run goes" in advice
    assert f"keep_rounds >= {max(per_fragment)} (Session(keep_rounds={max(per_fragment)}))" in (
        advice
    )

    kept = command("rm", url, stdin="\n")
    assert kept.returncode == 1
    assert f"Delete all {count(mailbox)} objects" in kept.stderr
    removed = command("rm", url, "--yes")
    assert removed.returncode == 0, removed.stderr
    assert count(mailbox) == 0
    gone = command("status", url)
    assert gone.returncode == 1
    assert "the prefix is empty" in gone.stderr


def test_sweep_and_verify_follow_payloads_stored_in_parts(
    mailbox: gm.Mailbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Payloads written in 128-byte parts (the learners); the CLI (with its own part size)
    verifies them and sweeps with --orphans without touching a kept payload's parts, nor
    leaving a swept payload's behind."""
    from gradientmail.payload import transfer as payload

    url = url_of(mailbox)
    command = Commands(mailbox)
    with monkeypatch.context() as learners:  # the CLI, in this process too, has the default
        learners.setattr(payload, "PART_BYTES", 128)
        history = train_run(mailbox)
    blobs = asyncio.run(mailbox.list(p.BLOBS))
    assert any(k.endswith(p.PARTS_SUFFIX) for k in blobs)
    checked = command("verify", url)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(history)} commits: {len(history)} verified" in checked.stdout
    swept = command("sweep", url, "--orphans", "--yes")
    assert swept.returncode == 0, swept.stderr
    left = set(asyncio.run(mailbox.list(p.BLOBS)))
    assert left < set(blobs)
    named: set[str] = set()
    for key in left:
        if key.endswith(p.PARTS_SUFFIX):
            data = asyncio.run(mailbox.get(key))
            assert data is not None
            named |= {part["key"] for part in json.loads(data)["parts"]}
    assert named <= left  # every kept payload is whole
    assert {k for k in left if not k.endswith(p.PARTS_SUFFIX)} <= named  # no orphaned part
    after = command("verify", url)
    assert after.returncode == 0, after.stdout + after.stderr
    assert verify_counts(after.stdout) == after_sweep(history)
    gm.align(make_model(), mailbox=mailbox)


# -- the errors ------------------------------------------------------------------------------


def test_status_shows_sync_points_per_learner(mailbox: gm.Mailbox) -> None:
    """Beats with sync-point counters (and one from a release without them), written into
    the store as learners write them: ``status`` and ``status --json`` show them per learner
    and name the learner that skips."""
    url = url_of(mailbox)
    command = Commands(mailbox)
    run = Run(mailbox)
    run.create()
    run.commit(2, {"alice": 16, "bob": 16})
    run.beat("alice", 4, steps=80, samples=640, sync_points=16, contributed=16, waited_s=2.5)
    run.beat("bob", 3, steps=80, samples=640, sync_points=16, contributed=4, skipped=12)
    run.old_beat("carol", 1, steps=7, samples=56)

    status = command("status", url, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    counters = {
        v["learner"]: (v["sync_points"], v["contributed"], v["waited_s"], v["skipped"])
        for v in view["learners"]
    }
    assert counters == {
        "alice": (16, 16, 2.5, 0),
        "bob": (16, 4, 0.0, 12),
        "carol": (0, 0, 0.0, 0),
    }
    assert [v["skipping"] for v in view["learners"]] == [False, True, False]
    assert view["sync"] == {
        "sync_points": 32,
        "contributed": 20,
        "waited_s": 2.5,
        "skipped": 12,
        "skipping": ["bob"],
        "stalling": [],
    }

    table = command("status", url)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = next(line for line in lines if line.startswith("learner"))
    assert header.split() == [
        "learner", "steps", "samples", "syncs", "contrib", "skipped", "waited", "lease", "(last",
        "beat)",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[lines.index(header) + 1 :]}
    assert rows["alice"][:7] == ["alice", "80", "640", "16", "16", "0", "2.5"]
    assert rows["bob"][:7] == ["bob", "80", "640", "16", "4", "12", "0.0"]
    assert rows["carol"][:7] == ["carol", "7", "56", "0", "0", "0", "0.0"]
    assert "sync points reached 32" in table.stdout
    assert "skipped 12" in table.stdout
    assert "skipping sync points: bob (12 of 16)" in table.stdout


def test_status_watch_flags_a_learner_that_waits(mailbox: gm.Mailbox) -> None:
    """Under --watch the share of time a learner waits at sync points is measured between
    the beats it sees; one that waits most of it is flagged as stalling."""
    url = url_of(mailbox)
    run = Run(mailbox)
    run.create()
    run.beat("dave", 1, steps=10, sync_points=1, contributed=1, waited_s=1.0)
    command = ["status", url, "--watch", "--json", "--interval", "0.1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradientmail.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        (dave,) = first["learners"]
        assert (dave["waited_s"], dave["waiting_fraction"], dave["stalling"]) == (1.0, None, False)
        # The watcher measures the share over a second or more between the beats it saw:
        # dave beats again each time the watcher has seen his newest beat, until it tells
        # the share (no wait on time: as many beats as the second takes polls). Each time
        # he has waited far more than the time between the beats: the share is capped at
        # 100%.
        deadline = time.monotonic() + TIMEOUT
        for beat in range(2, 1_000):
            run.beat("dave", beat, steps=9 + beat, sync_points=beat, contributed=beat,
                     waited_s=100.0)  # fmt: skip
            while (view := json.loads(proc.stdout.readline()))["learners"][0]["beat"] != beat:
                assert time.monotonic() < deadline
            (dave,) = view["learners"]
            if dave["waiting_fraction"] is not None:
                break
        assert (dave["waited_s"], dave["waiting_fraction"], dave["stalling"]) == (100.0, 1.0, True)
        assert view["sync"]["stalling"] == ["dave"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
        proc.wait()


def test_the_table_flags_stalling_learners() -> None:
    """The live table (``run``, and ``status --watch``): a line names the learners that
    stall, with their share of time waiting; ``status`` shows the share in the waited cell
    too (``run``'s table is wider and leaves it to that line)."""
    from rich.console import Console

    from gradientmail.cli.table import NodeRow, render_run
    from gradientmail.inspect import RunWatcher

    now = [0.0]
    run = Run(gm.MemoryMailbox())
    run.create()
    watcher = RunWatcher(run.box, clock=lambda: now[0])
    run.beat("erin", 1, steps=5, sync_points=1, contributed=1, waited_s=0.0)
    asyncio.run(watcher.poll())
    now[0] += 10.0
    run.beat("erin", 2, steps=9, sync_points=2, contributed=2, waited_s=4.0)
    view = asyncio.run(watcher.poll())

    def text(nodes: list[NodeRow] | None) -> str:
        with open(os.devnull, "w") as sink:
            console = Console(width=130, record=True, file=sink)
            console.print(render_run("run", view, polls=2, nodes=nodes))
        return console.export_text()

    flag = "waiting at sync points 25% of the time or more: erin (40%)"
    status = text(None)
    assert flag in status
    assert re.search(r"erin\s+9\s+0\s+2\s+2\s+0\s+4\.0 s \(40%\)\s+live", status), status
    under_run = text([NodeRow("erin", "training", 9, 100, 2.0, 1.5, 0)])
    assert flag in under_run
    assert re.search(r"erin\s+training\s+\S+\s+9/100 .* 2\s+2\s+0\s+4\.0 s live", under_run)
    assert "skipping" not in status + under_run


def test_an_empty_prefix_is_no_run(mailbox: gm.Mailbox, tmp_path: Path) -> None:
    url = url_of(mailbox)
    command = Commands(mailbox)
    for words in (["status"], ["verify"], ["align", "--out", str(tmp_path / "m")]):
        done = command(words[0], url, *words[1:])
        assert done.returncode == 1, done.stderr
        assert f"no run at {readable_url(url)}: the prefix is empty" in done.stderr
    assert command("rm", url, "--yes").stdout.startswith("nothing to delete")


def test_status_watch_waits_for_a_run_and_follows_it(mailbox: gm.Mailbox) -> None:
    url = url_of(mailbox)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradientmail.cli",
            "status",
            url,
            "--watch",
            "--json",
            "--interval",
            "0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["exists"] is False  # an empty prefix: it waits for the run
        claim = p.encode(p.CreatorClaim("carol"))
        assert asyncio.run(mailbox.put_if_absent(p.CREATOR, claim))
        deadline = time.monotonic() + TIMEOUT
        while (view := json.loads(proc.stdout.readline()))["creator"] != "carol":
            assert time.monotonic() < deadline
        assert view["exists"] is True
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0, err
    finally:
        proc.kill()
        proc.wait()


def test_a_foreign_prefix_is_named(mailbox: gm.Mailbox) -> None:
    url = url_of(mailbox)
    command = Commands(mailbox)
    asyncio.run(mailbox.put_if_absent("notes/readme.txt", b"not a run"))
    done = command("status", url)
    assert done.returncode == 1
    assert "is not a GradientMail run: 1 object (notes/readme.txt)" in done.stderr
    refused = command("rm", url, "--yes")
    assert refused.returncode == 1
    assert "add --force" in refused.stderr
    assert count(mailbox) == 1
    forced = command("rm", url, "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    assert count(mailbox) == 0
    asyncio.run(mailbox.put_if_absent(p.MANIFEST, b"{not json"))
    bad = command("status", url)
    assert bad.returncode == 1
    assert "is not a GradientMail run: manifest.json: not valid JSON" in bad.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "status", "message"),
    [
        ("runs/exp", 2, "'runs/exp' is not a mailbox URL"),
        ("memory://run", 2, "a memory:// mailbox lives inside one process"),
        ("ftp://host/run", 2, "unsupported scheme 'ftp'"),
        ("s3://bucket/run?colour=blue", 2, "unknown option 'colour'"),
        ("file:///nonexistent-gradientmail-dir", 1, "no such directory"),
    ],
)
def test_bad_urls_are_named(url: str, status: int, message: str) -> None:
    done = cli("status", url)
    assert done.returncode == status, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unreachable_store_fails_fast() -> None:
    url = f"s3://bucket/run?endpoint=http://127.0.0.1:{_closed_port()}"
    started = time.monotonic()
    done = cli("status", url, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", timeout=60)
    assert done.returncode == 1
    assert f"cannot reach the mailbox at {url}" in done.stderr
    assert time.monotonic() - started < 30


def test_a_directory_that_is_not_a_mailbox(tmp_path: Path) -> None:
    (tmp_path / "photo.jpg").write_bytes(b"")
    done = cli("verify", tmp_path.as_uri())
    assert done.returncode == 1
    assert "is not a GradientMail mailbox directory (no objects/ in it)" in done.stderr


# -- the spec file ---------------------------------------------------------------------------

RESOURCE = """\
apiVersion: gradientmail.dev/v1alpha1
kind: GradientMailRun
metadata:
  name: exp
spec:
  nodes: 2
  algorithm:
    syncEvery: {sync_every}
    fragments: 2
"""


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        (
            RESOURCE.format(sync_every=0),
            [],
            "run.yaml:8: spec.algorithm.syncEvery: must be an int >= 1 (got 0)",
        ),
        (RESOURCE.format(sync_every=10) + "  colour: blue\n", [], "run.yaml:10: spec.colour: "),
        (RESOURCE.format(sync_every=1), [], "run.yaml:7: spec.algorithm: algorithm.fragments"),
        ("nodes: 2\nalgorithm: {steps: many}\n", [], "run.yaml:2: spec.algorithm.steps: Input"),
        ("nodes: 2\n", ["--nodes", "0"], "--nodes: spec.nodes: Input should be greater"),
        ("nodes: [1\n", [], "run.yaml:2: not valid YAML"),
        ("kind: Pod\napiVersion: v1\n", [], "run.yaml:1: kind: expected 'GradientMailRun'"),
        (
            "nodes: 1\ntemplate:\n  env:\n  - {name: GRADIENTMAIL_NODES, value: '3'}\n",
            [],
            "run.yaml:3: spec.template.env: env GRADIENTMAIL_NODES",
        ),
        ("", [], "run.yaml: the file is empty"),
    ],
)
def test_a_bad_spec_file_points_at_the_field(
    tmp_path: Path, text: str, flags: list[str], message: str
) -> None:
    spec = tmp_path / "run.yaml"
    spec.write_text(text)
    done = cli("run", "-f", spec, *flags, "--workdir", tmp_path / "w")
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr.replace(str(tmp_path) + "/", "")
    assert not (tmp_path / "w").exists()  # nothing started


def test_flags_override_the_file_and_the_spec_alone_is_enough(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("nodes: 4\nalgorithm: {steps: 50, syncEvery: 10}\n")
    loaded = load_spec(spec, {"steps": 70, "nodes": None}, default_mailbox="file:///x")
    assert (loaded.spec.nodes, loaded.spec.algorithm.steps) == (4, 70)
    assert loaded.spec.mailbox.url == "file:///x"
    assert not loaded.has_mailbox
    assert loaded.resource["kind"] == "GradientMailRun"
    assert loaded.resource["metadata"] == {"name": "local"}


def test_ranges() -> None:
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0–2, 5, 7–8"
    assert _ranges([]) == ""


def test_demo_still_runs() -> None:
    done = cli("demo", "--nodes", "2", "--units", "4")
    assert done.returncode == 0, done.stderr
    assert "every unit claimed exactly once: True" in done.stdout


def test_the_console_script() -> None:
    script = Path(sys.executable).parent / "gradientmail"
    assert script.exists(), "scripts/install.sh installs the `gradientmail` console script"
    done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for command in ("run", "status", "align", "verify", "sweep", "rm", "demo"):
        assert command in done.stdout
