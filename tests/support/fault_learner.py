"""One learner of the fault suite (``tests/testing/test_fault_suite.py``), run as a real process:

    python -m tests.support.fault_learner --mailbox URL --learner NAME --index I --control DIR

It trains a tiny deterministic model (an MLP on synthetic regression data, the same init
everywhere, its own data stream per ``--index``) with :class:`gm.Session`, once
``--parties`` learners joined (a start barrier), until the file ``DIR/stop`` exists; closes
the session (which contributes the tail); waits for ``DIR/align``; loads the run's newest
commits into a fresh model with :func:`gm.align` and reports what it loaded. Everything it
has to say is one JSON object per line on stdout: ``starting``, ``joined``, ``started``,
``event`` (the Session's events, Published left out), ``hold`` (a fault wrapper stopped at
a write, see below), ``corrupted``, ``closed``, ``aligned``.

``python -m tests.support.fault_learner --serve`` is a fork server for the suite: it
imports everything once and forks one learner per request (see :func:`serve`).

Faults, all in a mailbox wrapper of this process (the library holds no test hooks):

- ``--lost-rate R``: :class:`FaultyMailbox` loses the response of a fraction R of all
  calls (the store applied them, the caller sees :class:`MailboxUnavailable`);
- ``--outage-flag PATH``: every call fails with :class:`MailboxUnavailable` while PATH
  exists (the filesystem's stand-in for a store outage);
- ``--closer hold|fail``: once ``DIR/arm`` exists, the first round this learner claims is
  held at its ``rounds/`` write: ``hold`` prints a ``hold`` line and blocks there (the
  test SIGKILLs it between claim and commit), ``fail`` prints it and fails every write of
  that record with a non-transient error while the process lives on (a live closer that
  keeps failing);
- ``--creator manifest|initial``: hold the write of ``manifest.json`` (a creator dying
  before the manifest), or of the first initial commit ``rounds/0..`` (after the manifest,
  before the initial commits), printing ``hold``;
- ``--corrupt``: once ``DIR/arm`` exists, the first snapshot this learner publishes has its
  payload bytes overwritten in the store (so its sha256 no longer matches) before the
  snapshot record is written, and this learner never claims that round (it would combine
  its own copy from memory, not the corrupt bytes).

Session keywords the installed :class:`gm.Session` does not accept are left out (so the
same worker also runs against an older engine, for proving that the suite can fail).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import gradientmail as gm

try:  # the layered tree (wire/), else the flat one (protocol.py) of earlier commits
    from gradientmail import wire as p
except ImportError:
    from gradientmail import protocol as p  # type: ignore[no-redef]
from gradientmail.errors import MailboxError, MailboxUnavailable
from gradientmail.mailbox import Mailbox
from gradientmail.payload import encode
from gradientmail.testing.faults import FaultyMailbox

IN_FEATURES = 8
HIDDEN = 16
SAMPLES = 1024
BATCH = 16
MODEL_SEED = 1234
BARRIER = "barriers/fault-suite-start/"
HOLD_LIMIT_S = 600.0  # a held write gives up after this (the test kills the process first)

_print_lock = threading.Lock()


def emit(kind: str, **record: Any) -> None:
    with _print_lock:
        print(json.dumps({"kind": kind, "t": time.time(), **record}, default=str), flush=True)


# -- the model ---------------------------------------------------------------------------------


def make_model() -> torch.nn.Module:
    torch.manual_seed(MODEL_SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def make_data(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.Generator().manual_seed(77)
    w = torch.randn(IN_FEATURES, 1, generator=teacher)
    own = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(SAMPLES, IN_FEATURES, generator=own)
    return x, torch.tanh(x @ w)


def fragment_keys(model: torch.nn.Module, manifest: p.Manifest) -> list[str]:
    """The payload key each fragment of ``model`` would be stored under: a commit's
    ``params`` exactly when the model holds that commit's bytes."""
    params = dict(model.named_parameters())
    return [
        encode({spec.name: params[spec.name].detach() for spec in specs})[0]
        for specs in manifest.fragments
    ]


# -- the fault wrapper -------------------------------------------------------------------------


def _round_of(key: str, prefix: str) -> int | None:
    """The round number in ``claims/{r}/...`` or ``snapshots/{r}/...``, else None."""
    if not key.startswith(prefix):
        return None
    head = key[len(prefix) :].partition("/")[0]
    return int(head) if head.isdigit() else None


async def overwrite(box: Mailbox, key: str, data: bytes) -> None:
    """Replace an object's bytes behind the protocol's back (create-once forbids it): the
    corruption a broken disk or a buggy tool leaves."""

    def write() -> None:
        if isinstance(box, gm.FileMailbox):
            path = box.root / "objects" / key
            scratch = path.with_name(path.name + ".corrupt")
            scratch.write_bytes(data)
            os.replace(scratch, path)
        elif isinstance(box, gm.S3Mailbox):
            client = box._client  # a test's fault injector reaching past the protocol
            full = f"{box.prefix}/{key}" if box.prefix else key
            client.put_object(Bucket=box.bucket, Key=full, Body=data)
        else:
            raise TypeError(f"cannot overwrite objects of {type(box).__name__}")

    await asyncio.to_thread(write)


class Faults(Mailbox):
    """The faults of this process's command line around ``inner`` (see the module docs).
    ``store`` is the real backend under every wrapper (for :func:`overwrite`)."""

    def __init__(self, inner: Mailbox, store: Mailbox, args: argparse.Namespace) -> None:
        self.inner = inner
        self.store = store
        self.learner: str = args.learner
        self.outage = Path(args.outage_flag) if args.outage_flag else None
        self.arm = Path(args.control) / "arm"
        self.closer_mode: str | None = args.closer
        self.creator_mode: str | None = args.creator
        self.corrupt = args.corrupt
        self.claimed: set[int] = set()  # rounds this learner won a claim of
        self.held_round: int | None = None  # the round whose record write is held / failed
        self.corrupt_round: int | None = None
        self.outage_failures = 0

    def _check_outage(self, op: str) -> None:
        if self.outage is not None and self.outage.exists():
            self.outage_failures += 1
            raise MailboxUnavailable(f"injected outage: {op}")

    async def _hold(self, key: str, what: str) -> None:
        emit("hold", learner=self.learner, key=key, what=what, pid=os.getpid())
        await asyncio.sleep(HOLD_LIMIT_S)  # the test SIGKILLs this process meanwhile
        raise MailboxUnavailable(f"injected hold of {key} ran out")

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        self._check_outage("put_if_absent")
        if self.creator_mode == "manifest" and key == p.MANIFEST:
            await self._hold(key, "manifest")
        if self.creator_mode == "initial" and key.startswith(p.ROUNDS):
            await self._hold(key, "initial commit")
        claim_round = _round_of(key, p.CLAIMS)
        if claim_round is not None and claim_round == self.corrupt_round:
            return False  # "someone else holds it": never close the round we corrupted
        if key.startswith(p.ROUNDS) and self.closer_mode is not None:
            r = p.parse_round_key(key)
            if self.held_round is None and r in self.claimed and self.arm.exists():
                self.held_round = r
                if self.closer_mode == "hold":
                    await self._hold(key, "closer")
                emit("hold", learner=self.learner, key=key, what="failing closer", pid=os.getpid())
            if r == self.held_round:
                raise MailboxError(f"injected: {self.learner} refuses to write {key}")
        snap_round = _round_of(key, p.SNAPSHOTS)
        if (
            self.corrupt
            and self.corrupt_round is None
            and snap_round is not None
            and key.endswith(f"/{self.learner}")
            and self.arm.exists()
        ):
            self.corrupt_round = snap_round
            payload = p.decode_snapshot(key, data).payload
            original = await self.store.get(payload)
            assert original is not None, payload
            spoiled = bytearray(original)
            spoiled[-1] ^= 0xFF  # the last byte of the tensor data: the hash no longer matches
            await overwrite(self.store, payload, bytes(spoiled))
            emit("corrupted", learner=self.learner, round=snap_round, payload=payload, key=key)
        won = await self.inner.put_if_absent(key, data)
        if won and claim_round is not None:
            self.claimed.add(claim_round)
        return won

    async def get(self, key: str) -> bytes | None:
        self._check_outage("get")
        return await self.inner.get(key)

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        self._check_outage("list")
        return await self.inner.list(prefix, after=after)

    async def delete(self, keys: Iterable[str]) -> None:
        self._check_outage("delete")
        await self.inner.delete(keys)


# -- the learner -------------------------------------------------------------------------------


def session_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Session keywords of the command line that this engine's Session accepts."""
    wanted = {
        "overlap": 0,
        "quorum_size": 1,
        "round_timeout": args.round_timeout,
        "lease_timeout": args.lease_timeout,
        "claim_timeout": args.claim_timeout,
        "wait_timeout": args.wait_timeout,
        "poll_interval": args.poll_interval,
        "idle_poll_interval": args.poll_interval * 4,
        "keep_rounds": args.keep_rounds,
        "join_timeout": args.join_timeout,
        "close_timeout": args.close_timeout,
    }
    accepted = inspect.signature(gm.Session).parameters
    return {name: value for name, value in wanted.items() if name in accepted}


def event_record(event: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(event) if dataclasses.is_dataclass(event) else {}
    return {"type": type(event).__name__, **fields}


def counters_record(counters: Any) -> dict[str, Any]:
    fields = dataclasses.asdict(counters)
    return {k: v for k, v in fields.items() if not isinstance(v, dict)}


async def start_barrier(box: Mailbox, learner: str, parties: int, deadline: float) -> None:
    """Train only once ``parties`` learners joined, so that all of them start at the same
    round of every fragment (as examples/synthetic.py's nodes do). A learner that joins
    while the others wait on a round of another fragment has been seen to lock the run into
    rounds that each close only after round_timeout (see the suite's report)."""
    await box.put_if_absent(BARRIER + learner, b"")
    while len(await box.list(BARRIER)) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{learner}: fewer than {parties} learners reached the start")
        await asyncio.sleep(0.02)


def wait_for_file(path: Path, deadline: float) -> bool:
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    deadline = time.monotonic() + args.timeout
    control = Path(args.control)
    store = gm.open_mailbox(args.mailbox)
    inner: Mailbox = store
    lossy: FaultyMailbox | None = None
    if args.lost_rate > 0:
        lossy = FaultyMailbox(store).randomly(args.lost_rate, seed=args.seed * 100 + args.index)
        inner = lossy
    box = Faults(inner, store, args)
    model = make_model()
    x, y = make_data(args.index)
    batches = torch.Generator().manual_seed(500 + args.index)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    algorithm = gm.DiLoCo(sync_every=args.sync_every, fragments=args.fragments)
    options = session_options(args)
    emit("starting", learner=args.learner, pid=os.getpid(), options=options)

    def on_event(event: Any) -> None:
        if type(event).__name__ == "Published":
            return
        emit("event", **{"learner": args.learner, **event_record(event)})

    session = gm.Session(
        model,
        algorithm=algorithm,
        mailbox=box,
        learner_id=args.learner,
        on_event=on_event,
        **options,
    )
    emit("joined", learner=args.learner, creator=session.creator, rounds=list(session.rounds))
    if args.parties > 1:
        asyncio.run(start_barrier(store, args.learner, args.parties, deadline))
        emit("started", learner=args.learner)
    stop = control / "stop"
    steps = 0
    try:
        while not stop.exists() and time.monotonic() < deadline:
            rows = torch.randint(0, SAMPLES, (BATCH,), generator=batches)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            loss.backward()
            optimizer.step()
            session.step(samples=BATCH)
            steps += 1
            if args.step_delay > 0:
                time.sleep(args.step_delay)
    except BaseException:
        session.__exit__(*sys.exc_info())
        raise
    close_error = None
    try:
        session.close()
    except Exception as exc:  # reported; the test decides what it means
        close_error = repr(exc)
    emit(
        "closed",
        learner=args.learner,
        steps=steps,
        rounds=list(session.rounds),
        counters=counters_record(session.counters()),
        error=close_error,
        lost=len(lossy.injected) if lossy is not None else 0,
        outage_failures=box.outage_failures,
    )
    if not wait_for_file(control / "align", deadline):
        emit("align-timeout", learner=args.learner)
        return 3
    fresh = make_model()
    with torch.no_grad():
        for param in fresh.parameters():
            param.fill_(float("nan"))  # nothing of the init survives unless align loads it
    rounds = gm.align(fresh, mailbox=store, timeout=60)
    manifest_bytes = asyncio.run(store.get(p.MANIFEST))
    manifest = p.decode_manifest(p.MANIFEST, manifest_bytes)
    emit(
        "aligned",
        learner=args.learner,
        rounds={str(k): v for k, v in rounds.items()},
        params=fragment_keys(fresh, manifest),
        finite=all(bool(torch.isfinite(t).all()) for t in fresh.parameters()),
    )
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    add = parser.add_argument
    add("--mailbox", required=True)
    add("--learner", required=True)
    add("--index", type=int, required=True, help="this learner's data stream")
    add("--control", required=True, help="the test's control directory (stop, align, arm)")
    add("--seed", type=int, default=0)
    add("--sync-every", type=int, default=8)
    add("--fragments", type=int, default=2)
    add("--lr", type=float, default=0.05)
    add("--step-delay", type=float, default=0.005)
    add("--round-timeout", type=float, default=8.0)
    add("--lease-timeout", type=float, default=1.5)
    add("--claim-timeout", type=float, default=3.0)
    add("--wait-timeout", type=float, default=30.0, help="step()'s bound on one wait")
    add("--poll-interval", type=float, default=0.05)
    add("--keep-rounds", type=int, default=100_000)
    add("--join-timeout", type=float, default=90.0)
    add("--close-timeout", type=float, default=60.0)
    add("--timeout", type=float, default=300.0, help="bound on this whole process")
    add("--parties", type=int, default=0, help="learners to wait for before training")
    add("--lost-rate", type=float, default=0.0)
    add("--outage-flag")
    add("--closer", choices=["hold", "fail"])
    add("--creator", choices=["manifest", "initial"])
    add("--corrupt", action="store_true")
    return parser.parse_args(argv)


# -- the fork server ---------------------------------------------------------------------------


def _preload() -> None:
    """Import what a learner imports lazily, so that a forked learner starts at once."""
    import boto3  # noqa: F401

    _ = gm.Session, gm.align, gm.verify, gm.DiLoCo


def _child(request: dict[str, Any]) -> None:
    """In a freshly forked process: become the learner the request describes; never return."""
    global _print_lock
    code = 1
    try:
        os.setsid()  # its own process group: a signal to it reaches nothing else
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd, target in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # Fresh stream objects and lock: nothing the server held at fork time is shared.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        _print_lock = threading.Lock()
        os.environ.update(request.get("env", {}))
        os.chdir(request.get("cwd", os.getcwd()))
        code = run(parse_args(request["argv"]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve() -> int:
    """A fork server: import everything once, then fork one learner per request.

    Requests are JSON lines on stdin: ``{"argv": [...], "out": path, "err": path, "env":
    {...}, "cwd": dir}``, answered ``{"kind": "forked", "pid": N}``; ``{"kill": N}`` sends
    SIGKILL to learner N if it has not ended. Every child that ends is reported ``{"kind":
    "exit", "pid": N, "status": S}`` (``-9``: SIGKILL). The
    learners are real processes of their own (own pid and process group), killed by pid;
    the server only spares each one the seconds of importing torch. On EOF it SIGKILLs the
    learners still running and exits.
    """
    import select
    import signal as signals

    _preload()
    children: set[int] = set()
    pending = b""

    def say(record: dict[str, Any]) -> None:
        os.write(1, (json.dumps(record) + "\n").encode())

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            say({"kind": "exit", "pid": pid, "status": os.waitstatus_to_exitcode(status)})

    say({"kind": "ready", "pid": os.getpid()})
    try:
        while True:
            readable, _, _ = select.select([0], [], [], 0.05)
            reap()
            if not readable:
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if not line.strip():
                    continue
                request = json.loads(line)
                if "kill" in request:
                    # Here, not in the test: only this process knows whether the pid is
                    # still its unreaped child (so never someone else's reused pid).
                    if request["kill"] in children:
                        os.kill(request["kill"], signals.SIGKILL)
                    continue
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children.add(pid)
                say({"kind": "forked", "pid": pid})
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signals.SIGKILL)
        for pid in list(children):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        if sys.argv[1:] == ["--serve"]:
            sys.exit(serve())
        sys.exit(run(parse_args()))
