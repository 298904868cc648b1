"""The node processes of ``gradientmail run``: starting, reading, restarting, stopping.

Each node runs in its own process group (a session of its own too, when it is one
process), so the terminal's Ctrl-C reaches only ``gradientmail run``, which then stops
every group in order (SIGINT, SIGTERM, SIGKILL). A node of ``--procs-per-node`` P > 1 is P
ranks in that one group
(:class:`gradientmail.launch.ranks.Ranks`: torchrun's environment, one learner, a rank that
fails stops its siblings and fails the node). A reader thread per node copies rank 0's
output to the node's log and takes the progress the built-in node prints (``…: step N
loss X …``, and ``val Y``, a validation loss of its own model, kept with the time it
arrived); ranks 1.. write to ``logs/{learner}.rank{R}.log``. The mailbox (beats) tells the
rest. :class:`Watch` polls the run's mailbox on its own thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from gradientmail.cli.table import NodeRow, SampleRate
from gradientmail.errors import MailboxError
from gradientmail.inspect import RunView, RunWatcher
from gradientmail.launch.env import NodeEnv
from gradientmail.launch.ranks import Output, RankFailure, Ranks
from gradientmail.mailbox import Mailbox

__all__ = ["Interrupted", "Node", "Runner", "Watch", "group_alive"]

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|nan|inf)"
STEP_RE = re.compile(rf"\bstep (?P<step>\d+)\b(?:.*?\bloss (?P<loss>{_NUMBER}))?")
VAL_RE = re.compile(rf"\bval (?P<val>{_NUMBER})")
TAIL_LINES = 30


class Interrupted(Exception):
    """Ctrl-C, SIGTERM or SIGHUP reached ``gradientmail run``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Node:
    index: int
    env: NodeEnv
    log: Path
    state: str = "starting"
    step: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    restarts: int = 0
    proc: subprocess.Popen[bytes] | None = None  # rank 0, leader of the node's group
    ranks: Ranks | None = None
    failure: RankFailure | None = None  # the rank whose exit failed the node, last time
    reader: threading.Thread | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    exit_code: int | None = None
    val_curve: list[tuple[float, float]] = field(default_factory=list)  # (monotonic, loss)

    @property
    def learner(self) -> str:
        return self.env.learner_id

    def rank_log(self, rank: int) -> Path:
        """Where rank ``rank``'s output goes (rank 0's: the node's log)."""
        return self.log if rank == 0 else self.log.with_name(f"{self.learner}.rank{rank}.log")

    def failure_tail(self) -> tuple[Path, list[str]]:
        """The log of the rank that failed the node, and its last lines."""
        if self.failure is None or self.failure.rank == 0:
            return self.log, list(self.tail)
        path = self.rank_log(self.failure.rank)
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        return path, lines[-TAIL_LINES:]

    def row(self) -> NodeRow:
        return NodeRow(
            self.learner,
            self.state,
            self.step,
            self.env.steps,
            self.first_loss,
            self.last_loss,
            self.restarts,
        )

    def see(self, line: str) -> None:
        """Take what a line of output says about progress."""
        self.tail.append(line)
        if self.state == "starting" and ("training" in line or "step" in line):
            self.state = "training"
        match = STEP_RE.search(line)
        if match is None:
            return
        val = VAL_RE.search(line, match.end("step"))
        if val is not None:
            self.val_curve.append((time.monotonic(), float(val["val"])))
        self.step = max(self.step, int(match["step"]))
        if self.state == "training" and self.step >= self.env.steps:
            self.state = "finishing"  # leaving the session, waiting for the others
        if match["loss"] is not None:
            loss = float(match["loss"])
            if self.first_loss is None:
                self.first_loss = loss
            self.last_loss = loss


# -- processes -----------------------------------------------------------------------------


class Runner:
    def __init__(
        self,
        nodes: list[Node],
        command: list[str],
        base_env: dict[str, str],
        workdir: Path,
        max_restarts: int,
        procs: int = 1,
    ) -> None:
        self.nodes = nodes
        self.procs = procs
        self.command = command
        self.base_env = base_env
        self.workdir = workdir
        self.restarts_left = max_restarts
        self.lines: queue.Queue[tuple[Node, str]] = queue.Queue()

    def start(self, node: Node) -> None:
        logs = [node.rank_log(rank).open("ab") for rank in range(self.procs)]
        if node.restarts:
            for log in logs:
                log.write(f"--- restart {node.restarts} ---\n".encode())
                log.flush()

        def output(rank: int) -> Output:
            return subprocess.PIPE if rank == 0 else logs[rank]

        # Its own process group (the terminal's Ctrl-C is ours), every rank in it.
        try:
            node.ranks = Ranks.start(
                self.command, self.base_env | node.env.to_environ(), self.procs, output=output
            )
        except BaseException:
            logs[0].close()
            raise
        finally:
            for log in logs[1:]:
                log.close()  # the ranks write their own copies
        node.proc = node.ranks.procs[0]
        node.state, node.exit_code, node.failure = "starting", None, None
        log = logs[0]
        assert node.proc.stdout is not None
        node.reader = threading.Thread(
            target=self._read,
            args=(node, node.proc.stdout, log),
            name=f"read-{node.learner}",
            daemon=True,
        )
        node.reader.start()
        self.write_nodes()

    def _read(self, node: Node, stream: IO[bytes], log: IO[bytes]) -> None:
        with log, stream:
            for raw in stream:
                log.write(raw)
                log.flush()
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                node.see(line)
                self.lines.put((node, line))

    def write_nodes(self) -> None:
        records = [
            {
                "learner": n.learner,
                "index": n.index,
                "pid": n.proc.pid if n.proc else None,
                "pgid": n.proc.pid if n.proc else None,  # leader of its own group
                "pids": [p.pid for p in n.ranks.procs] if n.ranks else [],  # every rank
                "restarts": n.restarts,
                "log": str(n.log),
            }
            for n in self.nodes
        ]
        target = self.workdir / "nodes.json"
        target.with_suffix(".tmp").write_text(json.dumps(records, indent=2))
        target.with_suffix(".tmp").replace(target)

    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.ranks is not None and n.ranks.alive()]

    def reap(self) -> Node | None:
        """Note exits; restart failed nodes within the budget; return a node that failed
        for good (None while none has)."""
        for node in self.nodes:
            if node.ranks is None or node.exit_code is not None:
                continue
            code = node.ranks.poll()  # a failed rank has its siblings stopped here
            if code is None:
                continue
            if node.reader is not None:
                node.reader.join(timeout=5)
            node.exit_code = code
            if code == 0:
                node.state = "done"
                continue
            node.failure = node.ranks.failure
            rank = node.failure.rank if node.failure is not None else 0
            node.state = f"failed (exit {code})" if self.procs == 1 else f"failed (rank {rank})"
            if self.procs > 1:
                self.lines.put(
                    (
                        node,
                        f"[gradientmail run] rank {rank} exited {code} (log: "
                        f"{node.rank_log(rank)}); the node's other ranks were stopped",
                    )
                )
            if self.restarts_left <= 0:
                return node
            self.restarts_left -= 1
            node.restarts += 1
            self.lines.put((node, f"[gradientmail run] exit {code}; restarting as {node.learner}"))
            self.start(node)
        return None

    def signal_all(self, signum: int) -> None:
        for node in self.nodes:
            if node.proc is None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(node.proc.pid, signum)

    def stop(self, grace: float) -> None:
        """SIGINT, ``grace`` seconds, SIGTERM, a few seconds, SIGKILL; every process group
        is empty afterwards. A second Ctrl-C goes straight to SIGKILL."""
        steps = [(signal.SIGINT, grace), (signal.SIGTERM, min(3.0, grace)), (signal.SIGKILL, 10.0)]
        for signum, wait in steps:
            if not self.alive() and signum != signal.SIGKILL:
                continue
            self.signal_all(signum)
            deadline = time.monotonic() + wait
            try:
                while self.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
            except (KeyboardInterrupt, Interrupted):
                continue  # impatient: next signal now
        for node in self.nodes:
            if node.proc is not None and node.ranks is not None:
                code = node.ranks.wait(timeout=5)
                if node.exit_code is None:
                    node.exit_code = code
                    node.state = "stopped"
                # What the node started itself (same group) goes too.
                deadline = time.monotonic() + 5
                while group_alive(node.proc.pid) and time.monotonic() < deadline:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(node.proc.pid, signal.SIGKILL)
                    time.sleep(0.05)
            if node.reader is not None:
                node.reader.join(timeout=2)


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


# -- watching the mailbox ------------------------------------------------------------------


class Watch(threading.Thread):
    """Polls the run's mailbox on its own thread and event loop; keeps the newest view."""

    def __init__(self, box: Mailbox, interval: float) -> None:
        super().__init__(name="gradientmail-watch", daemon=True)
        self.box = box
        self.interval = interval
        self.view: RunView | None = None
        self.error: str | None = None
        self.polls = 0
        self.rate = SampleRate()
        self._halt = threading.Event()

    def run(self) -> None:
        asyncio.run(self._loop())

    async def _loop(self) -> None:
        watcher = RunWatcher(self.box)
        while not self._halt.is_set():
            await self.poll_once(watcher)
            deadline = time.monotonic() + self.interval
            while not self._halt.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await self.poll_once(watcher)  # the final state, after the nodes are gone

    async def poll_once(self, watcher: RunWatcher) -> None:
        try:
            self.view = await watcher.poll()
            self.polls += 1
            self.rate.add(time.monotonic(), self.view.samples_committed)
            self.error = None
        except MailboxError as exc:
            self.error = str(exc)

    def finish(self) -> None:
        self._halt.set()
        self.join(timeout=30)
