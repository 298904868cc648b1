"""Child processes of the tests (kopf, ``kubectl get -w``) in their own process groups.

A :class:`ManagedProcess` writes stdout and stderr to a log file, is never reaped before
:meth:`~ManagedProcess.stop` (its status is peeked with ``WNOWAIT``, so its process group id
cannot be reused while it may still be signalled), and ``stop`` ends the whole group: SIGTERM,
SIGKILL after a timeout, SIGKILL to stragglers, reap.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["ManagedProcess", "pid_alive"]

STOP_TIMEOUT_S = 10.0


class ManagedProcess:
    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"=== {shlex.join(self.argv)}\n".encode())
            log.flush()
            self._popen = subprocess.Popen(
                self.argv,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pid = self._popen.pid
        self._lock = threading.Lock()
        self._stopped = False

    def output(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace")

    def exit_status(self) -> int | None:
        """The exit status (-N for signal N) once it has ended, without reaping it."""
        if self._popen.returncode is not None:
            return self._popen.returncode
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return self._popen.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.exit_status() is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """End the process group (SIGTERM, then SIGKILL after ``timeout`` s); its status."""
        with self._lock:
            if not self._stopped:
                if self.exit_status() is None:
                    self._signal_group(signal.SIGTERM)
                    if not self._wait_exit(timeout):
                        self._signal_group(signal.SIGKILL)
                        self._wait_exit(timeout)
                self._signal_group(signal.SIGKILL)  # stragglers; the unreaped leader holds the id
                self._popen.wait()
                self._stopped = True
            return self._popen.returncode


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
