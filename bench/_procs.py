"""The learner-process harness every benchmark shares.

Three ways a benchmark runs learners, one home each:

- :func:`spawn` and :func:`gather`: N ``multiprocessing`` (spawn) processes running
  ``target(index, *args, barrier, queue)`` (its body wrapped in :func:`bench._harness.guarded`),
  their results gathered from the queue until all came, one failed (the others get a grace
  period, then are stopped), the processes exited, they went silent, or the time ran out
  (``step``, ``sync``, ``utilization``, ``memory``);
- :class:`Job`, :func:`run_together` and :func:`run_pool`: ``bench._quality_worker`` processes
  given a JSON job file (``quality``'s learners, evaluations and in-process arms), forked
  from a server that imported torch and gradientmail once (:func:`_job_context`);
- :func:`stores`: a fresh mailbox per configuration, on the filesystem or on a SeaweedFS
  server started for it (``testbed/s3servers.py``), removed afterwards;
- inside a learner, :class:`Events`: a Session's events with the time each came.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _harness as h

# -- spawned learner processes ---------------------------------------------------------------


def spawn(
    target: Callable[..., None], n: int, args: Sequence[Any], name: str, *, barrier: bool = True
) -> tuple[list[Any], Any, Any]:
    """Start ``n`` processes ``target(i, *args, barrier, queue)`` (``barrier`` False: no
    barrier argument); return them, the queue and the barrier."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    meeting = context.Barrier(n) if barrier else None
    tail = (meeting, queue) if barrier else (queue,)
    procs = [
        context.Process(target=target, args=(i, *args, *tail), name=f"{name}-{i}", daemon=True)
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    return procs, queue, meeting


def gather(
    procs: Sequence[Any],
    queue: Any,
    expected: int,
    label: str,
    *,
    limit_s: float | None = None,
    stall_s: float | None = None,
    check: Callable[[], str | None] = lambda: None,
    on_result: Callable[[dict[str, Any]], None] = lambda _: None,
    on_stop: Callable[[], list[str]] = list,
    join_s: float = 60.0,
) -> tuple[list[dict[str, Any]], list[str]]:
    """The results ``procs`` put on ``queue`` until ``expected`` came; and what went wrong.

    Besides results, a process puts ``{"progress": ...}`` (echoed; with ``beat``, learner-0's
    only), ``{"beat": i, "failure": ...}`` (a failure event, echoed and returned among the
    errors only when the run stops early) and ``{"index": i, "error": ...}`` (from
    :func:`bench._harness.guarded`). After an error the others get 30 s (they fail at a
    barrier or wait for a round that will not close). ``check`` returning a message stops the
    run (memory running short); ``on_stop`` adds words to the errors before the processes are
    ended. The processes are joined (``join_s``), then killed."""
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    failures: list[str] = []
    start = heard = time.monotonic()
    grace: float | None = None
    finished = False
    try:
        while len(results) < expected:
            problem = check()
            if problem is not None:
                errors.append(problem)
                break
            now = time.monotonic()
            if limit_s is not None and now > start + limit_s:
                errors.append("gave up waiting for the learners (time limit)")
                break
            if stall_s is not None and now > heard + stall_s:
                errors.append(f"stalled: no news from the processes in {stall_s:g} s")
                break
            if grace is not None and now > grace:
                errors.append("gave up waiting for the other processes after an error")
                break
            try:
                item = queue.get(timeout=0.2)
            except queue_module.Empty:
                if all(p.exitcode is not None for p in procs):
                    errors.append(f"processes exited: {[p.exitcode for p in procs]}")
                    break
                continue
            heard = time.monotonic()
            if "failure" in item:
                failures.append(f"learner-{item['beat']}: {item['failure']}")
                h.progress(f"{label}: learner-{item['beat']}: {item['failure']}")
            elif "progress" in item:
                if item.get("beat", 0) == 0:  # learner-0 (or the reference) speaks for all
                    h.progress(f"{label}: {item['progress']}")
            elif "error" in item:
                errors.append(f"learner-{item['index']}: {item['error']}")
                h.progress(f"{label}: learner-{item['index']} failed:\n{item.get('traceback')}")
                if grace is None:  # the others fail at a barrier, or wait for a round
                    grace = time.monotonic() + 30
            else:
                results.append(item)
                on_result(item)
        finished = True
    finally:
        if not finished:  # interrupted: stop them at once
            errors.append("interrupted")
        if errors:  # what the processes reached before they are stopped
            errors += on_stop()
            if failures:
                errors.append(f"failure events: {failures[:4]}")
        for p in procs:
            p.join(timeout=join_s if not errors else 2)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    for item in results:
        item["failure_events"] = [x for x in failures if x.startswith(f"learner-{item['index']}:")]
    return sorted(results, key=lambda r: int(r["index"])), errors


# -- mailboxes -------------------------------------------------------------------------------


@contextmanager
def stores(backend: str, workdir: Path, names: Sequence[str]) -> Iterator[list[Any]]:
    """A fresh ``gm.Mailbox`` per name (``<name>-<random>``): a directory each, or a prefix
    each on one SeaweedFS server started for them. Removed afterwards."""
    import gradientmail as gm

    slugs = [f"{name}-{uuid.uuid4().hex[:6]}" for name in names]
    roots = [workdir / slug for slug in slugs]
    try:
        if backend == "filesystem":
            yield [gm.FileMailbox(root) for root in roots]
            return
        from testbed import s3servers

        h.progress(f"{names[0] if len(names) == 1 else backend}: starting SeaweedFS")
        with s3servers.seaweedfs(roots[0].with_name(f"seaweedfs-{slugs[0]}")) as server:
            yield [server.mailbox(slug) for slug in slugs]
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(roots[0].with_name(f"seaweedfs-{slugs[0]}"), ignore_errors=True)


@contextmanager
def store(backend: str, workdir: Path, name: str) -> Iterator[Any]:
    """One fresh mailbox (:func:`stores`)."""
    with stores(backend, workdir, [name]) as boxes:
        yield boxes[0]


@contextmanager
def seaweedfs_specs(workdir: Path, name: str) -> Iterator[Callable[[], dict[str, Any]]]:
    """A SeaweedFS server; each call describes a fresh prefix on it for a child process
    (``_quality_worker.open_box``)."""
    from testbed import s3servers

    with s3servers.seaweedfs(workdir / "seaweedfs") as server:

        def box() -> dict[str, Any]:
            return {
                "kind": "s3",
                "bucket": server.bucket,
                "prefix": f"{name}-{uuid.uuid4().hex[:8]}",
                "endpoint_url": server.endpoint_url,
                "access_key": server.access_key,
                "secret_key": server.secret_key,
            }

        yield box


# -- worker subprocesses (JSON in, JSON out) -------------------------------------------------


class JobFailed(RuntimeError):
    """A worker subprocess failed or timed out: its error and the tail of its log."""


def _job_context() -> Any:
    """Where job processes come from: a ``multiprocessing`` fork server that imported the
    worker module (torch, gradientmail) once. Each job is still its own process, with its
    own memory and its own mailbox traffic; it only skips the ~2.5 CPU-s interpreter and
    torch start-up a fresh ``python -m`` pays (27 learner processes per ``--quick`` run).
    The server is forked before any job runs a torch op, so no thread pool crosses a fork."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["bench._quality_worker"])
    return context


def _run_job(module: str, path: str, log: str, env: Mapping[str, str]) -> None:
    """A job process's body: its output to ``log``, its environment, then the module's
    ``main`` as ``python -m module path`` would run it."""
    import importlib

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(h.ROOT)
    sys.argv = [module, path]
    code = importlib.import_module(module).main([path])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the server's atexit hooks: this process only ran one job


@dataclass
class Job:
    """``<module>.main([<name>.job.json])`` in a process of its own, forked from the job
    server (:func:`_job_context`); it writes ``<name>.out.json`` in ``dir``."""

    name: str
    spec: dict[str, Any]
    timeout: float
    dir: Path
    module: str = "bench._quality_worker"
    proc: Any = None  # a multiprocessing Process
    started: float = 0.0
    result: dict[str, Any] | None = None

    @property
    def out(self) -> Path:
        return self.dir / f"{self.name}.out.json"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    def start(self, env: Mapping[str, str]) -> None:
        spec = dict(self.spec, out=str(self.out))
        path = self.dir / f"{self.name}.job.json"
        path.write_text(json.dumps(spec))
        self.log.write_bytes(b"")
        self.proc = _job_context().Process(
            target=_run_job,
            args=(self.module, str(path), str(self.log), dict(env)),
            name=self.name,
            daemon=True,
        )
        self.proc.start()
        self.started = time.monotonic()

    def finished(self) -> bool:
        """True once the process exited (its result read) or was ended for its timeout."""
        assert self.proc is not None
        if self.proc.exitcode is None:
            if time.monotonic() - self.started <= self.timeout:
                return False
            self.kill()
            self.result = {"error": f"timed out after {self.timeout:.0f} s"}
            return True
        if self.result is None:
            try:
                self.result = json.loads(self.out.read_text())
            except (OSError, ValueError):
                self.result = {"error": f"exit status {self.proc.exitcode}, no result"}
            if self.proc.exitcode != 0 and "error" not in self.result:
                self.result["error"] = f"exit status {self.proc.exitcode}"
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join(timeout=30)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def value(self) -> dict[str, Any]:
        assert self.result is not None
        if "error" in self.result:
            raise JobFailed(f"{self.name}: {self.result['error']}\n{self.tail()}")
        return self.result


def child_env(threads: int) -> dict[str, str]:
    """This environment, with the gradientmail beside this bench/ first on the path and
    ``threads`` intra-op threads."""
    env = dict(os.environ)
    paths = [str(h.ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[name] = str(threads)
    return env


def run_pool(
    jobs: Sequence[Job],
    parallel: int,
    env: Mapping[str, str],
    on_done: Callable[[Job], None] = lambda _: None,
) -> None:
    """Run ``jobs``, ``parallel`` at a time; each is bounded by its own timeout."""
    waiting = list(jobs)
    running: list[Job] = []
    try:
        while waiting or running:
            while waiting and len(running) < parallel:
                job = waiting.pop(0)
                job.start(env)
                running.append(job)
            time.sleep(0.2)
            for job in [j for j in running if j.finished()]:
                running.remove(job)
                on_done(job)
    finally:
        for job in running:
            job.kill()


def run_together(jobs: Sequence[Job], env: Mapping[str, str], label: str) -> None:
    """Start ``jobs`` at once (a run's learners); when one fails, end the others (they would
    wait for it until their timeout). Bounded by the largest timeout."""
    for job in jobs:
        job.start(env)
    next_note = time.monotonic() + 30
    try:
        while True:
            done = [job.finished() for job in jobs]
            failed = [
                j for j, d in zip(jobs, done, strict=True) if d and "error" in (j.result or {})
            ]
            if failed or all(done):
                break
            if time.monotonic() >= next_note:
                next_note = time.monotonic() + 30
                last = jobs[0].tail(1).strip()
                if last:
                    h.progress(f"{label}: {last}")
            time.sleep(0.2)
    finally:
        for job in jobs:
            job.kill()
    for job in jobs:
        job.finished()


# -- inside a learner process ----------------------------------------------------------------

FAILED = ("PollFailed", "PublishFailed", "RoundFailed")


class Events:
    """A ``gm.Session``'s ``on_event``: each event with the ``time.monotonic()`` it came at
    (one clock for every process of a machine), under a lock (the Session's threads call)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[tuple[float, Any]] = []

    def __call__(self, event: Any) -> None:
        with self._lock:
            self._seen.append((time.monotonic(), event))

    def of(self, *kinds: type) -> list[tuple[float, Any]]:
        with self._lock:
            return [(t, e) for t, e in self._seen if isinstance(e, kinds)]

    def failures(self, names: Sequence[str] = FAILED, since: float = 0.0) -> list[str]:
        """``repr`` of the events named ``names`` (failures) that came at ``since`` or later."""
        with self._lock:
            return [repr(e) for t, e in self._seen if type(e).__name__ in names and t >= since]
