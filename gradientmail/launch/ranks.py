"""A node of many processes (no torch): its P ranks, started with torchrun's environment,
living and dying together. The one home for spawning ranks: ``gradientmail run`` starts
each node through :class:`Ranks`, and an operator pod with ``spec.procsPerNode`` P > 1 runs
``python -m gradientmail.launch.ranks --procs P -- COMMAND ...`` (:func:`main`).

Every rank gets the node's environment unchanged (the same ``GRADIENTMAIL_*`` variables:
one learner id for the node) plus torchrun's: ``RANK`` = ``LOCAL_RANK`` = r,
``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = P, ``GROUP_RANK`` = 0, ``MASTER_ADDR`` 127.0.0.1
and ``MASTER_PORT`` a free loopback port chosen per start of the node, so
``torch.distributed.init_process_group()`` (env://) forms the node's group. With P = 1 the
command runs alone with the node's environment only, as before ranks existed.

The ranks share one process group, led by rank 0 (``gradientmail run`` and the stop
signals address it by rank 0's pid); a node of one process leads a session of its own.
When a rank exits non-zero the others get SIGTERM, then SIGKILL after :data:`STOP_GRACE`
seconds, and the node's exit code is the failing rank's: a node never keeps training with
a rank missing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from gradientmail import settings

__all__ = [
    "RANKS_MODULE",
    "STOP_GRACE",
    "RankFailure",
    "Ranks",
    "free_port",
    "launcher_command",
    "main",
    "rank_environ",
]

RANKS_MODULE = "gradientmail.launch.ranks"

STOP_GRACE = 5.0  # seconds the other ranks get after SIGTERM before SIGKILL
POLL = 0.1  # seconds between looks at the ranks (the pod launcher)
LOOPBACK = "127.0.0.1"

Output = int | IO[bytes] | None  # what a rank's stdout is: PIPE, a file, inherited (None)


def free_port() -> int:
    """A loopback TCP port free right now (the OS picks it), for a node's ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def rank_environ(rank: int, procs: int, port: int) -> dict[str, str]:
    """torchrun's variables for local rank ``rank`` of a one-machine node of ``procs``."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(procs),
        "LOCAL_WORLD_SIZE": str(procs),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(procs),
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
    }


def launcher_command(procs: int, command: Sequence[str]) -> list[str]:
    """What a pod runs for a node of ``procs`` ranks of ``command``: :func:`main` through
    the command's own interpreter when it is a Python one (``python3 train.py``), else
    ``python`` (the image's, with gradientmail installed)."""
    head = list(command[:1])
    python = head[0] if head and Path(head[0]).name.startswith("python") else "python"
    return [python, "-m", RANKS_MODULE, "--procs", str(procs), "--", *command]


@dataclass(frozen=True)
class RankFailure:
    """The rank whose non-zero exit ended its node."""

    rank: int
    code: int


class Ranks:
    """A node's ranks (one process when ``procs`` is 1), as one unit: started together,
    polled together, stopped together."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.failure: RankFailure | None = None
        self._stopping_since: float | None = None

    @classmethod
    def start(
        cls,
        command: Sequence[str],
        env: Mapping[str, str],
        procs: int,
        *,
        output: Callable[[int], Output] = lambda rank: None,
        port: int | None = None,
    ) -> Ranks:
        """Start ``command`` as ``procs`` ranks in a new process group led by rank 0
        (``output(rank)``: its stdout, stderr going with it; None inherits ours)."""
        settings.LAUNCH["procs_per_node"].check("Ranks", procs)
        master = free_port() if procs > 1 and port is None else port
        started: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(procs):
                extra = {} if procs == 1 else rank_environ(rank, procs, master or 0)
                stdout = output(rank)
                started.append(
                    subprocess.Popen(
                        list(command),
                        env={**env, **extra},
                        stdin=subprocess.DEVNULL,
                        stdout=stdout,
                        stderr=subprocess.STDOUT if stdout is not None else None,
                        # Rank 0 leads a new process group, not the terminal's foreground
                        # one (the terminal's Ctrl-C is the launcher's); the others join it.
                        # A lone rank leads a session of its own, as nodes always did; ranks
                        # stay in ours, since a process can only join a group of its own
                        # session. Rank 0 is not waited for before the last rank has
                        # started, so even when it exits at once its zombie keeps the group
                        # in existence for the others to join.
                        start_new_session=procs == 1,
                        process_group=None if procs == 1 else (started[0].pid if rank else 0),
                    )
                )
        except OSError:
            for proc in started:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
            raise
        return cls(started)

    @property
    def pid(self) -> int:
        """Rank 0's pid: also the id of the ranks' process group."""
        return self.procs[0].pid

    def alive(self) -> bool:
        return any(proc.poll() is None for proc in self.procs)

    def signal(self, signum: int) -> None:
        """``signum`` to every rank still running (by process, not by group: a group id can
        be reused once its last member is reaped)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    def poll(self) -> int | None:
        """None while the node runs; once every rank has exited, 0 when each exited 0, else
        the first failing rank's code (:attr:`failure`). A rank's failure stops the others
        at once (SIGTERM, SIGKILL after :data:`STOP_GRACE`)."""
        codes = [proc.poll() for proc in self.procs]
        if self.failure is None:
            for rank, code in enumerate(codes):
                if code is not None and code != 0:
                    self.failure = RankFailure(rank, code)
                    self._stopping_since = time.monotonic()
                    self.signal(signal.SIGTERM)
                    break
        elif (
            self._stopping_since is not None
            and time.monotonic() - self._stopping_since > STOP_GRACE
            and None in codes
        ):
            self.signal(signal.SIGKILL)
        if None in codes:
            return None
        return 0 if self.failure is None else self.failure.code

    def wait(self, timeout: float) -> int | None:
        """:meth:`poll` until the node has exited or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or time.monotonic() >= deadline:
                return code
            time.sleep(0.02)


# -- the pod's launcher: python -m gradientmail.launch.ranks --procs P -- COMMAND ... --------


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m gradientmail.launch.ranks",
        description="Run COMMAND as P local ranks with torchrun's environment (one node of a "
        "GradientMailRun with spec.procsPerNode P); exit with the first failing rank's code "
        "after stopping the others.",
    )
    parser.add_argument("--procs", type=int, required=True, help="ranks to start (P >= 1)")
    parser.add_argument(
        "--logs",
        type=Path,
        help="a folder for the output of ranks 1.. (rank{R}.log); default: ours, interleaved",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the command after --")
    if not settings.LAUNCH["procs_per_node"].valid(args.procs):
        parser.error(f"--procs {args.procs}: must be {settings.LAUNCH['procs_per_node'].rule()}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Start the ranks, pass SIGTERM/SIGINT/SIGHUP on to them (the kubelet signals only the
    container's first process), and exit as the node did."""
    args = _arguments(sys.argv[1:] if argv is None else argv)
    files: list[IO[bytes]] = []

    def output(rank: int) -> Output:
        if rank == 0 or args.logs is None:
            return None
        args.logs.mkdir(parents=True, exist_ok=True)
        files.append((args.logs / f"rank{rank}.log").open("ab"))
        return files[-1]

    ranks = Ranks.start(args.command, os.environ, args.procs, output=output)
    for handle in files:
        handle.close()  # the ranks hold their own copies

    def forward(signum: int, frame: FrameType | None) -> None:
        ranks.signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    code = ranks.poll()
    while code is None:  # bounded by the ranks' own lifetime
        time.sleep(POLL)
        code = ranks.poll()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
