"""``gradientmail run``: local node processes with the operator's environment, a live table
on a terminal (checked through a pty), a failing node's log tail, and Ctrl-C leaving no
process behind."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from fcntl import ioctl
from pathlib import Path

import pytest
import yaml

from gradientmail.cli._nodes import group_alive
from gradientmail.launch.runspec import GradientMailRunSpec, node_env
from gradientmail_operator import render
from tests.cli.test_cli import cli
from tests.support.waiting import TEST_TIMEOUT, wait_until

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Za-z0-9]|\r")


@pytest.fixture(autouse=True)
def _synthetic_task(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in node trains its synthetic task here (seconds, not the language model's
    minute): these tests are about the processes and the table; ``test_demo_lm.py`` runs
    the model."""
    monkeypatch.setenv("GRADIENTMAIL_TASK", "synthetic")


def groups_gone(workdir: Path) -> bool:
    """True when no process is left running in any node's process group."""
    return not any(group_alive(pgid) for pgid in node_pgids(workdir))


def node_pgids(workdir: Path) -> list[int]:
    return [n["pgid"] for n in json.loads((workdir / "nodes.json").read_text())]


def kill_groups(pgids: list[int]) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def test_run_trains_with_the_builtin_node(tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    done = cli(
        "run",
        *("--nodes", "2", "--steps", "60", "--sync-every", "10", "--fragments", "2"),
        *("--round-timeout", "2", "--workdir", workdir),
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    url = (workdir / "mailbox").as_uri()
    assert f"mailbox    {url}" in done.stdout
    for node in ("local-node-0", "local-node-1"):
        assert f"{node}: step 60 loss" in done.stdout
        assert "step 60 loss" in (workdir / "logs" / f"{node}.log").read_text()
    assert re.search(
        r"done in [\d.]+ s: 2 nodes, \d+ training rounds committed, mean loss", done.stdout
    )
    assert f"gradientmail align {url} --out model.safetensors" in done.stdout
    resource = yaml.safe_load((workdir / "run.yaml").read_text())
    assert resource["kind"] == "GradientMailRun"
    assert resource["spec"]["mailbox"] == {"url": url}
    status = cli("status", url, "--json")
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["rounds_committed"] >= 1
    assert {v["learner"] for v in view["learners"]} == {"local-node-0", "local-node-1"}


ENV_DUMP = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('GRADIENTMAIL_', 'TEAM'))}))"
)


def test_nodes_get_the_environment_the_operator_injects(tmp_path: Path) -> None:
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(
        """\
apiVersion: gradientmail.dev/v1alpha1
kind: GradientMailRun
metadata: {name: exp}
spec:
  nodes: 3
  mailbox:
    endpoint: http://minio.gradientmail:9000
    bucket: runs
    credentialsSecret: {name: s3}
  barriers: {epoch-1: 2}
  algorithm: {syncEvery: 30, fragments: 3, outerLr: 0.5, quorum: 2, steps: 90}
  template:
    env:
    - {name: TEAM, value: vision}
    - name: TEAM_TOKEN
      valueFrom: {secretKeyRef: {name: t, key: token}}
"""
    )
    workdir = tmp_path / "w"
    done = cli("run", "-f", spec_file, "--workdir", workdir, "--", "python", "-c", ENV_DUMP)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TEAM_TOKEN comes from a Kubernetes source" in done.stderr
    url = (workdir / "mailbox").as_uri()
    spec = GradientMailRunSpec.model_validate(yaml.safe_load(spec_file.read_text())["spec"])
    for index in range(3):
        seen = json.loads((workdir / "logs" / f"exp-node-{index}.log").read_text())
        # The built-in node's own settings (GRADIENTMAIL_TASK) pass through from the caller.
        assert seen.pop("GRADIENTMAIL_TASK") == "synthetic"
        assert seen == node_env(spec, "exp", index, url).to_environ() | {"TEAM": "vision"}
        # ... which is what the operator puts into the pod, for the same mailbox URL.
        pod = render.pod_manifest(spec, namespace="ns", run="exp", uid="u", index=index, url=url)
        plain = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
        assert seen == plain


def test_a_failing_node_ends_the_run_with_its_log_tail(tmp_path: Path) -> None:
    script = (
        "import os, sys, time\n"
        "if os.environ['GRADIENTMAIL_NODE_INDEX'] == '1':\n"
        "    print('loading shard 7', flush=True)\n"
        "    sys.exit('shard 7 is corrupt')\n"
        "time.sleep(3600)\n"  # stopped by the run, or the cli() call below times out
    )
    workdir = tmp_path / "w"
    done = cli(
        "run",
        "--nodes",
        "2",
        "--max-restarts",
        "1",
        "--workdir",
        workdir,
        "--",
        "python",
        "-c",
        script,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "local-node-1 failed (exit 1) after 1 restarts" in done.stderr
    assert "shard 7 is corrupt" in done.stderr
    log = (workdir / "logs" / "local-node-1.log").read_text()
    assert "--- restart 1 ---" in log
    assert log.count("loading shard 7") == 2
    assert groups_gone(workdir)  # node 0 was stopped


def test_a_node_traceback_shows_as_one_line_and_stays_whole_in_the_log(tmp_path: Path) -> None:
    script = (
        "def join():\n"
        "    raise ConnectionError('the store refused the key')\n"
        "try:\n"
        "    join()\n"
        "except ConnectionError as exc:\n"
        "    raise RuntimeError('join failed') from exc\n"
    )
    workdir = tmp_path / "w"
    done = cli(
        "run", "--nodes", "1", "--max-restarts", "0", "--workdir", workdir,
        "--", "python", "-c", script,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    shown = done.stdout + done.stderr
    assert "Traceback" not in shown, shown
    assert "RuntimeError: join failed" in shown
    log = (workdir / "logs" / "local-node-0.log").read_text()
    assert "Traceback (most recent call last):" in log
    assert "ConnectionError: the store refused the key" in log


def test_ctrl_c_escalates_to_sigkill_for_nodes_that_ignore_it(tmp_path: Path) -> None:
    # A stubborn node ignores SIGINT and SIGTERM and has a child of its own.
    script = (
        "import signal, subprocess, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen(['sleep', '300'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(300)\n"
    )
    workdir = tmp_path / "w"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradientmail.cli",
            "run",
            "--nodes",
            "2",
            "--workdir",
            str(workdir),
            "--stop-timeout",
            "1",
            "--",
            "python",
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pgids: list[int] = []
    try:
        logs = [workdir / "logs" / f"local-node-{i}.log" for i in range(2)]
        wait_until(
            lambda: all(log.exists() and "ready" in log.read_text() for log in logs),
            "both nodes ready",
        )
        pgids = node_pgids(workdir)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TEST_TIMEOUT)
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert time.monotonic() - started < 15  # 1 s for SIGINT, 1 s for SIGTERM, SIGKILL
        assert "interrupted (SIGTERM): every node was stopped" in err
        assert groups_gone(workdir)  # the nodes' own children too
    finally:
        proc.kill()
        kill_groups(pgids)


class Terminal:
    """``gradientmail`` on a pseudo-terminal, as a person would run it."""

    def __init__(self, args: list[str], columns: int = 130, lines: int = 40) -> None:
        env = os.environ | {"TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(lines)}
        env.pop("NO_COLOR", None)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a session of its own, the pty its terminal
            try:
                os.execve(sys.executable, [sys.executable, "-m", "gradientmail.cli", *args], env)
            finally:
                os._exit(127)
        ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        self.raw = b""
        self.status: int | None = None

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def read(self, seconds: float = 0.1) -> None:
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if ready:
            try:
                self.raw += os.read(self.fd, 65536)
            except OSError:  # the child closed the terminal
                time.sleep(seconds)

    def exited(self) -> bool:
        self.read(0.05)  # keep draining, or a full pty blocks the child
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status is not None

    def close(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_the_live_table_updates_and_ctrl_c_stops_every_node(tmp_path: Path) -> None:
    workdir = tmp_path / "w"
    term = Terminal(
        [
            "run",
            "--nodes",
            "2",
            "--steps",
            "100000",
            "--sync-every",
            "50",
            "--workdir",
            str(workdir),
        ]
    )
    pgids: list[int] = []
    try:
        progress = re.compile(r"local-node-0\s+training\s+\S+\s+(\d+)/100000")

        def updated() -> bool:
            term.read()
            values = set(progress.findall(term.text))
            committed = set(re.findall(r"rounds committed (\d+)", term.text))
            return len(values) >= 2 and len(committed) >= 2

        slow = max(60.0, TEST_TIMEOUT)  # two torch imports and a start barrier first
        wait_until(updated, "the live table to show training progress twice", slow, every=0)
        text = term.text
        for heading in ("rounds committed", "live learners", "samples/s", "commit lag", "progress"):
            assert heading in text
        assert "lease (last beat)" in text
        pgids = node_pgids(workdir)
        os.write(term.fd, b"\x03")  # Ctrl-C, through the terminal
        # The run's own stop is bounded (gradientmail/cli/_nodes.py, Nodes.stop): SIGINT and
        # the default 10 s grace, SIGTERM and 3 s, SIGKILL and 10 s, then per node up to 5 s
        # to reap, 5 s to empty its group and 2 s for its log reader. The guard is that bound
        # plus the start-up allowance, so only a stop that overran its own bound fails here
        # (60 s alone was less than the bound on a loaded machine).
        stop_bound = 10 + 3 + 10 + 2 * (5 + 5 + 2)
        wait_until(term.exited, "gradientmail run to exit after Ctrl-C", stop_bound + slow)
        assert term.status == 130, term.text[-2000:]
        assert "interrupted (SIGINT): every node was stopped" in term.text
        assert re.search(r"local-node-0\s+stopped", term.text)
        assert groups_gone(workdir)
    finally:
        term.close()
        kill_groups(pgids)


def test_the_spec_mailbox_gets_a_fresh_prefix(tmp_path: Path) -> None:
    base = (tmp_path / "base").as_uri()
    spec_file = tmp_path / "run.yaml"
    spec_file.write_text(f"nodes: 1\nmailbox: {{url: '{base}'}}\n")
    workdir = tmp_path / "w"
    done = cli(
        "run",
        "-f",
        spec_file,
        "--mailbox",
        "spec",
        "--workdir",
        workdir,
        "--",
        "python",
        "-c",
        ENV_DUMP,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads((workdir / "logs" / "local-node-0.log").read_text())
    assert seen["GRADIENTMAIL_MAILBOX"] == f"{base}/local/w"
    no_mailbox = cli("run", "--mailbox", "spec", "--workdir", tmp_path / "x")
    assert no_mailbox.returncode == 2
    assert "the spec file names no mailbox" in no_mailbox.stderr


def test_run_against_an_unreachable_store_fails_fast(tmp_path: Path) -> None:
    url = "s3://bucket/run?endpoint=http://127.0.0.1:1"
    started = time.monotonic()
    done = cli(
        "run",
        "--mailbox",
        url,
        "--workdir",
        tmp_path / "w",
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="y",
        timeout=60,
    )
    assert done.returncode == 1
    assert f"cannot reach the mailbox at {url}" in done.stderr
    assert time.monotonic() - started < 30
    assert not (tmp_path / "w" / "nodes.json").exists()  # no node was started
