"""Round-protocol benchmark: bytes, requests, commit latency and step() cost per learner,
against references measured in the same run.

Several learners (threads of this process, each with its own model copy and its own
``gm.Session``) train a model of ``--params`` float32 parameters with a cheap fake step (a
little noise added to every tensor, then a short sleep standing in for accelerator time), so
the run is communication-bound. One mailbox per configuration: SeaweedFS (started fresh by
this script, one prefix per configuration) or ``gm.FileMailbox`` in a temporary directory.
After ``--warmup`` training rounds, ``--rounds`` committed rounds are measured.

Measured, per learner and committed round (window deltas of ``session.counters()``):

1. bytes up + down, against the lower bound of one fragment up and one fragment down
   (fragment bytes = parameter bytes / fragments);
2. requests;
3. commit latency: ``Applied.lag_s`` (from this learner's ``Published`` to its ``Applied``),
   median, against a raw put + get of one fragment's bytes on the same store (a plain
   ``boto3`` ``put_object`` + ``get_object`` on SeaweedFS; a file write + fsync + read for the
   filesystem), measured in the same run;
4. time inside ``session.step()`` on the training thread, for calls that snapshot a
   fragment, calls that apply a commit, and plain calls, against a bare training step
   (forward + backward + SGD) of a 1M-parameter MLP at batch 32 on the CPU.

A recording wrapper under each session's mailbox attributes every byte to what it carried
(snapshot / params / momentum payloads, JSON records) and every round's latency to its
phases (waiting for the other learners, close detection, closer work, syncer).

    .venv/bin/python bench/rounds.py [--backends seaweedfs,filesystem] [--learners 2,4]
        [--fragments 1,4] [--params 10M] [--rounds 16] [--warmup 3] [--sync-every 8]
        [--poll-interval 0.5] [--step-ms 5] [--max-seconds 100]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import gradientmail as gm
from gradientmail import events as ev
from tests.support import s3servers

MIB = 1024 * 1024
BATCH = 32


def _progress(message: str) -> None:
    print(f"  .. {message}", file=sys.stderr, flush=True)


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def _parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    return int(float(number) * scale)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# -- recording mailbox ---------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    learner: str
    thread: str  # "comm", "sync", or "main" (join / leave)
    op: str  # put / get / list / delete
    key: str
    up: int
    down: int
    start: float
    end: float
    ok: bool | None = None  # put_if_absent's answer


class Registry:
    """What each blob key carried, learned from the records the learners wrote."""

    def __init__(self) -> None:
        self.purpose: dict[str, str] = {}
        self.closer: dict[int, str] = {}  # round -> the learner whose record won
        self.params_round: dict[str, int] = {}  # params blob -> its round
        self.lock = threading.Lock()

    def note_put(self, learner: str, key: str, data: bytes, created: bool) -> None:
        if key.startswith("snapshots/"):
            with contextlib.suppress(ValueError, KeyError):
                with self.lock:
                    self.purpose.setdefault(json.loads(data)["payload"], "snapshot")
        elif key.startswith("rounds/") and created:
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(data)
                with self.lock:
                    self.purpose[record["params"]] = "params"
                    self.params_round[record["params"]] = int(record["round"])
                    if record.get("momentum"):
                        self.purpose[record["momentum"]] = "momentum"
                    self.closer[int(record["round"])] = learner


class Recorder(gm.Mailbox):
    """Passes every call to ``inner`` and logs it (thread, key, bytes, start and end)."""

    def __init__(self, inner: gm.Mailbox, learner: str, log: list[Op], registry: Registry):
        self.inner = inner
        self.learner = learner
        self.log = log
        self.registry = registry

    def _thread(self) -> str:
        name = threading.current_thread().name  # the Session's loop threads are named
        if name.startswith("gm-comm"):
            return "comm"
        return "sync" if name.startswith("gm-sync") else "main"

    async def put_if_absent(self, key: str, data: bytes) -> bool:
        thread, start = self._thread(), time.monotonic()
        created = None
        try:
            created = await self.inner.put_if_absent(key, data)
            return created
        finally:
            self.log.append(
                Op(self.learner, thread, "put", key, len(data), 0, start, time.monotonic(), created)
            )
            if created is not None:
                self.registry.note_put(self.learner, key, data, created)

    async def get(self, key: str) -> bytes | None:
        thread, start = self._thread(), time.monotonic()
        data = None
        try:
            data = await self.inner.get(key)
            return data
        finally:
            size = len(data or b"")
            self.log.append(Op(self.learner, thread, "get", key, 0, size, start, time.monotonic()))

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        thread, start = self._thread(), time.monotonic()
        try:
            return await self.inner.list(prefix, after=after)
        finally:
            self.log.append(Op(self.learner, thread, "list", prefix, 0, 0, start, time.monotonic()))

    async def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        thread, start = self._thread(), time.monotonic()
        try:
            await self.inner.delete(keys)
        finally:
            first = keys[0] if keys else ""
            self.log.append(
                Op(self.learner, thread, "delete", first, 0, 0, start, time.monotonic())
            )


def _round_of(key: str) -> int | None:
    parts = key.split("/")
    if len(parts) >= 2 and parts[0] in ("rounds", "snapshots", "claims") and parts[1].isdigit():
        return int(parts[1])
    return None


def purpose_of(op: Op, registry: Registry) -> str:
    """What an operation carried, e.g. ``put snapshot`` or ``get params (closer)``."""
    kind = op.key.partition("/")[0]
    if kind == "blobs" and op.op in ("put", "get"):
        what = registry.purpose.get(op.key, "blob?")
        if op.op == "get" and what == "params":
            r = registry.params_round.get(op.key)
            closer = registry.closer.get(r) if r is not None else None
            who = "by its closer" if closer == op.learner else op.thread
            return f"get params ({who})"
        return f"{op.op} {what}"
    return f"{op.op} {kind} (records)"


# -- models and steps ----------------------------------------------------------------------


def build_model(params: int, fragments: int) -> torch.nn.Sequential:
    """A stack of square Linear layers holding about ``params`` parameters."""
    layers = max(8, fragments)  # two tensors per layer: enough for every fragment
    width = max(16, round(math.sqrt(params / layers) / 16) * 16)
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))


def reference_step(steps: int) -> list[float]:
    """Seconds per bare training step of a ~1M-parameter MLP at batch 32 on the CPU."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 1_100_000
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, 512)
    y = torch.randint(0, 10, (BATCH,))
    times = []
    for i in range(steps + 20):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return times


# -- targets -------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    open_box: Callable[[], tuple[gm.Mailbox, Callable[[], None]]]  # fresh run -> (box, cleanup)
    raw_put_get: Callable[[bytes], float]  # seconds for a raw put + get of these bytes


@contextmanager
def seaweedfs_target(workdir: Path) -> Iterator[Target]:
    _progress("starting SeaweedFS")
    with s3servers.seaweedfs(workdir / "seaweedfs") as server:
        client = server.client()

        def open_box() -> tuple[gm.Mailbox, Callable[[], None]]:
            prefix = f"rounds-{uuid.uuid4().hex[:8]}"
            box = gm.S3Mailbox(
                server.bucket,
                prefix,
                endpoint_url=server.endpoint_url,
                aws_access_key_id=server.access_key,
                aws_secret_access_key=server.secret_key,
            )
            return box, lambda: None

        def raw_put_get(data: bytes) -> float:
            key = f"raw-{uuid.uuid4().hex}"
            start = time.perf_counter()
            client.put_object(Bucket=server.bucket, Key=key, Body=data, IfNoneMatch="*")
            body = client.get_object(Bucket=server.bucket, Key=key)["Body"].read()
            took = time.perf_counter() - start
            assert len(body) == len(data)
            client.delete_object(Bucket=server.bucket, Key=key)
            return took

        yield Target("seaweedfs", open_box, raw_put_get)


@contextmanager
def file_target(workdir: Path) -> Iterator[Target]:
    raw_dir = workdir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)

    def open_box() -> tuple[gm.Mailbox, Callable[[], None]]:
        root = workdir / f"file-{uuid.uuid4().hex[:6]}"
        return gm.FileMailbox(root), lambda: shutil.rmtree(root, ignore_errors=True)

    def raw_put_get(data: bytes) -> float:
        path = raw_dir / uuid.uuid4().hex
        start = time.perf_counter()
        with open(path, "wb") as handle:  # FileMailbox's default is fsync=True: so here
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        body = path.read_bytes()
        took = time.perf_counter() - start
        assert len(body) == len(data)
        path.unlink()
        return took

    yield Target("filesystem", open_box, raw_put_get)


# -- one configuration ---------------------------------------------------------------------


@dataclass
class StepSample:
    seconds: float
    kind: str  # "snapshot", "apply", "plain"
    at: float


@dataclass
class Learner:
    learner_id: str
    session: gm.Session
    events: list[tuple[float, ev.Event]] = field(default_factory=list)
    steps: list[StepSample] = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class Result:
    backend: str
    learners: int
    fragments: int
    params: int
    fragment_bytes: float
    rounds: int
    seconds: float
    up_down: float  # bytes per learner per round
    requests: float  # per learner per round
    lag: list[float]
    raw: float  # seconds, median raw put + get of one fragment
    steps: dict[str, list[float]]
    purposes: dict[str, float]  # bytes per learner per round by purpose
    requests_by: dict[str, float]  # per learner per round by op:kind
    phases: dict[str, list[float]]
    partial: bool
    skipped: int
    errors: list[str]
    counters_total: float = 0.0
    recorder_total: float = 0.0
    closes: float = 0.0  # closer runs (puts of rounds/ records) per committed round
    ref_step: list[float] = field(default_factory=list)  # bare 1M-param training steps


class Run:
    def __init__(self, args: argparse.Namespace, target: Target, learners: int, fragments: int):
        self.args = args
        self.target = target
        self.n = learners
        self.p = fragments
        self.log: list[Op] = []
        self.registry = Registry()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.committed = fragments - 1  # newest committed round seen (initial: 0..P-1)

    def on_event(self, learner: Learner) -> Callable[[ev.Event], None]:
        def handle(event: ev.Event) -> None:
            now = time.monotonic()
            learner.events.append((now, event))
            if isinstance(event, ev.Committed | ev.Applied):
                with self.lock:
                    self.committed = max(self.committed, event.round)

        return handle

    def train(self, learner: Learner, noise: torch.Tensor, index: int) -> None:
        session = learner.session
        params = list(session.model.parameters())
        alpha = 1e-4 * (1 + index)  # distinct per learner: no two snapshots share a hash
        pause = self.args.step_ms / 1000
        due = session.algorithm.due_fragment
        try:
            while not self.stop.is_set():
                with torch.no_grad():
                    for param in params:
                        flat = param.view(-1)
                        n = min(flat.numel(), noise.numel())
                        flat[:n].add_(noise[:n], alpha=alpha)
                if pause:
                    time.sleep(pause)
                rounds = session.rounds
                skipped = session.counters().skipped_syncs
                start = time.perf_counter()
                session.step(samples=BATCH)
                took = time.perf_counter() - start
                snap = due(session.steps) is not None
                if snap and session.counters().skipped_syncs != skipped:
                    snap = False
                kind = "snapshot" if snap else "apply" if session.rounds != rounds else "plain"
                learner.steps.append(StepSample(took, kind, time.monotonic()))
        except BaseException as exc:
            learner.error = exc

    def execute(self) -> Result:
        box, cleanup = self.target.open_box()
        try:
            return self._execute(box)
        finally:
            cleanup()

    def _execute(self, box: gm.Mailbox) -> Result:
        args = self.args
        name = f"{self.target.name} L={self.n} P={self.p}"
        base = build_model(args.params, self.p)
        total_params = sum(x.numel() for x in base.parameters())
        param_bytes = sum(x.numel() * x.element_size() for x in base.parameters())
        fragment_bytes = param_bytes / self.p
        algorithm = gm.DiLoCo(sync_every=args.sync_every, fragments=self.p)

        _progress(f"{name}: reference: {args.ref_steps} bare steps of a 1M-param MLP")
        ref_step = reference_step(args.ref_steps)
        _progress(f"{name}: raw put+get of {fragment_bytes / MIB:.1f} MiB x{args.reps}")
        blob = os.urandom(int(fragment_bytes))
        raw = [self.target.raw_put_get(blob) for _ in range(args.reps)]
        del blob

        _progress(f"{name}: joining {self.n} learners ({total_params / 1e6:.1f}M params)")
        learners: list[Learner] = []
        for i in range(self.n):
            model = copy.deepcopy(base)
            learner_id = f"learner-{i}"
            holder: list[Learner] = []

            def relay(event: ev.Event, holder: list[Learner] = holder) -> None:
                if holder:
                    self.on_event(holder[0])(event)

            session = gm.Session(
                model,
                algorithm=algorithm,
                mailbox=Recorder(box, learner_id, self.log, self.registry),
                learner_id=learner_id,
                poll_interval=args.poll_interval,
                on_event=relay,
            )
            learner = Learner(learner_id, session)
            holder.append(learner)
            learners.append(learner)
        del base

        noise = torch.randn(4096)
        threads = [
            threading.Thread(target=self.train, args=(x, noise, i), name=f"train-{i}", daemon=True)
            for i, x in enumerate(learners)
        ]
        started = time.monotonic()
        for thread in threads:
            thread.start()

        warm_until = self.p - 1 + args.warmup
        deadline = started + args.max_seconds
        t0 = r0 = None
        c0: list[ev.Counters] = []
        partial = False
        last_note = 0.0
        while True:
            time.sleep(0.02)
            with self.lock:
                newest = self.committed
            now = time.monotonic()
            if t0 is None and newest >= warm_until:
                c0 = [x.session.counters() for x in learners]
                t0, r0 = now, newest
            if t0 is not None and r0 is not None and newest >= r0 + args.rounds:
                break
            if now > deadline:
                partial = True
                break
            if any(x.error for x in learners):
                break
            if now - last_note > 5:
                last_note = now
                done = 0 if r0 is None else newest - r0
                phase = "warm-up" if r0 is None else f"{done}/{args.rounds} measured"
                _progress(f"{name}: round {newest} ({phase}, {now - started:.0f} s)")
        c1 = [x.session.counters() for x in learners]
        t1 = time.monotonic()
        with self.lock:
            r1 = self.committed
        if t0 is None or r0 is None:  # never warmed up: measure all of it
            c0 = [ev.Counters() for _ in learners]
            t0, r0 = started, self.p - 1
        self.stop.set()
        for thread in threads:
            thread.join(timeout=30)

        _progress(f"{name}: closing ({r1 - r0} rounds measured in {t1 - t0:.1f} s)")
        errors = [f"{x.learner_id}: {x.error!r}" for x in learners if x.error]
        closers = [
            threading.Thread(target=self._close, args=(x, errors), daemon=True) for x in learners
        ]
        for thread in closers:
            thread.start()
        for thread in closers:
            thread.join(timeout=60)

        result = self._analyse(
            learners, c0, c1, t0, t1, r0, r1, raw, total_params, fragment_bytes, partial, errors
        )
        result.ref_step = ref_step
        return result

    def _close(self, learner: Learner, errors: list[str]) -> None:
        try:
            learner.session.close(timeout=30)
        except Exception as exc:
            errors.append(f"{learner.learner_id} close: {exc!r}")

    # -- analysis --------------------------------------------------------------------------

    def _analyse(
        self,
        learners: list[Learner],
        c0: list[ev.Counters],
        c1: list[ev.Counters],
        t0: float,
        t1: float,
        r0: int,
        r1: int,
        raw: list[float],
        total_params: int,
        fragment_bytes: float,
        partial: bool,
        errors: list[str],
    ) -> Result:
        rounds = max(1, r1 - r0)
        per = rounds * self.n

        def delta(name: str) -> float:
            total = 0
            for a, b in zip(c0, c1, strict=True):
                before, after = getattr(a, name), getattr(b, name)
                total += sum(after.values()) - sum(before.values())
            return float(total)

        up_down = (delta("bytes_up") + delta("bytes_down")) / per
        requests = delta("requests") / per
        requests_by: Counter[str] = Counter()
        for a, b in zip(c0, c1, strict=True):
            for key, value in b.requests.items():
                requests_by[key] += value - a.requests.get(key, 0)
        skipped = sum(b.skipped_syncs - a.skipped_syncs for a, b in zip(c0, c1, strict=True))

        # Commit latency: the learners' own Applied.lag_s, for rounds in the window.
        window = range(r0 + 1, r1 + 1)
        lag = [
            e.lag_s
            for x in learners
            for _, e in x.events
            if isinstance(e, ev.Applied) and e.contributed and e.round in window
        ]

        # Bytes by what they carried (recorder), ops that ended inside the window.
        purposes: Counter[str] = Counter()
        recorded = 0
        closes = 0
        for op in self.log:
            if t0 <= op.end <= t1:
                closes += op.op == "put" and op.key.startswith("rounds/")
                label = purpose_of(op, self.registry)
                if op.up:
                    purposes[f"{label} [up]"] += op.up
                if op.down:
                    purposes[f"{label} [down]"] += op.down
                recorded += op.up + op.down
        steps: dict[str, list[float]] = defaultdict(list)
        for x in learners:
            for sample in x.steps:
                if t0 <= sample.at <= t1:
                    steps[sample.kind].append(sample.seconds)
        return Result(
            backend=self.target.name,
            learners=self.n,
            fragments=self.p,
            params=total_params,
            fragment_bytes=fragment_bytes,
            rounds=rounds,
            seconds=t1 - t0,
            up_down=up_down,
            requests=requests,
            lag=lag,
            raw=_median(raw),
            steps=dict(steps),
            purposes={k: v / per for k, v in purposes.items()},
            requests_by={k: v / per for k, v in requests_by.items()},
            phases=self._phases(learners, window),
            partial=partial,
            skipped=skipped,
            errors=errors,
            counters_total=(delta("bytes_up") + delta("bytes_down")),
            recorder_total=float(recorded),
            closes=closes / rounds,
        )

    def _phases(self, learners: list[Learner], window: range) -> dict[str, list[float]]:
        """Split each (round, contributor) latency into the phases it went through."""
        published: dict[tuple[int, str], float] = {}
        claim: dict[int, float] = {}
        record: dict[int, float] = {}
        closer_ops: dict[int, list[Op]] = defaultdict(list)
        round_seen: dict[tuple[int, str], float] = {}
        params_get: dict[tuple[int, str], Op] = {}
        round_by_params = self.registry.params_round
        for op in self.log:
            r = _round_of(op.key)
            if op.op == "put" and op.key.startswith("snapshots/") and r is not None:
                published[(r, op.learner)] = op.end
            elif op.op == "put" and op.key.startswith("claims/") and op.ok and r is not None:
                claim[r] = op.start
            elif op.op == "put" and op.key.startswith("rounds/") and op.ok and r is not None:
                record[r] = op.end
            elif op.op == "get" and op.key.startswith("rounds/") and op.thread == "sync":
                if r is not None:
                    round_seen.setdefault((r, op.learner), op.start)
            elif op.op == "get" and op.thread == "sync" and op.key in round_by_params:
                params_get[(round_by_params[op.key], op.learner)] = op
        for op in self.log:
            if op.thread != "comm":
                continue
            for r, start in claim.items():
                end = record.get(r)
                closer = self.registry.closer.get(r)
                if end is not None and op.learner == closer and start <= op.start <= op.end <= end:
                    closer_ops[r].append(op)
        applied: dict[tuple[int, str], float] = {}
        for x in learners:
            for at, e in x.events:
                if isinstance(e, ev.Applied) and e.contributed:
                    applied[(e.round, x.learner_id)] = at
        phases: dict[str, list[float]] = defaultdict(list)
        for r in window:
            mine = [(k[1], t) for k, t in published.items() if k[0] == r]
            if not mine or r not in claim or r not in record:
                continue
            last = max(t for _, t in mine)
            transfer = sum(o.end - o.start for o in closer_ops[r] if o.key.startswith("blobs/"))
            phases["close detection"].append(claim[r] - last)
            phases["closer: payload transfers"].append(transfer)
            phases["closer: other (records, combine, encode)"].append(
                record[r] - claim[r] - transfer
            )
            for learner, t in mine:
                if (r, learner) not in applied:
                    continue
                phases["wait for other learners"].append(last - t)
                seen = round_seen.get((r, learner))
                if seen is not None:
                    phases["syncer: sees the record"].append(seen - record[r])
                get = params_get.get((r, learner))
                if get is not None:
                    phases["syncer: params download"].append(get.end - get.start)
                phases["record -> applied"].append(applied[(r, learner)] - record[r])
        return dict(phases)


# -- tables --------------------------------------------------------------------------------


def _size(n: float) -> str:
    if n >= 1024 * MIB:
        return f"{n / 1024 / MIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _secs(s: float) -> str:
    if math.isnan(s):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> None:
    rows = [list(r) for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def _purpose_order(label: str) -> tuple[int, str]:
    order = ("put snapshot", "put params", "put momentum", "get snapshot", "get params")
    for i, prefix in enumerate((*order, "get momentum")):
        if label.startswith(prefix) and "(records)" not in label:
            return (i, label)
    return (len(order) + 1, label)


def _config(r: Result) -> str:
    return f"{r.backend} L={r.learners} P={r.fragments}"


CLOSER_WORK = ("put params", "put momentum", "get snapshot", "get momentum", "get params (by")
CONTRIBUTOR_WORK = ("put snapshot", "get params (sync)")


def print_report(results: list[Result], args: argparse.Namespace) -> None:
    print()
    print(
        f"## Round protocol, per learner per committed round ({args.params / 1e6:.0f}M float32 "
        f"params, sync_every={args.sync_every}, poll_interval={args.poll_interval} s, fake "
        f"step {args.step_ms:g} ms)"
    )
    print()
    header = [
        "backend",
        "learners",
        "fragments",
        "params",
        "rounds",
        "up+down / learner / round",
        "lower bound",
        "ratio (<= 1.2)",
        "requests / round",
        "commit latency (median)",
        "raw put+get",
        "ratio (< 2)",
        "closes / round",
    ]
    rows = []
    for r in results:
        bound = 2 * r.fragment_bytes
        lag = _median(r.lag)
        mark = "*" if r.partial else ""
        rows.append(
            [
                r.backend,
                str(r.learners),
                str(r.fragments),
                f"{r.params / 1e6:.1f}M",
                f"{r.rounds}{mark}",
                _size(r.up_down),
                _size(bound),
                f"{r.up_down / bound:.2f}x",
                f"{r.requests:.1f}",
                _secs(lag),
                _secs(r.raw),
                f"{lag / r.raw:.1f}x",
                f"{r.closes:.2f}",
            ]
        )
    _table(header, rows)
    print()
    print(
        "Lower bound: one fragment up + one down (fragment = parameter bytes / fragments). "
        "Raw put+get: one fragment, boto3 put_object + get_object (SeaweedFS) or write + fsync "
        "+ read (filesystem), median of --reps. `closes / round`: puts of the `rounds/` "
        "record per committed round (1.00 when each round is closed once)."
    )
    if any(r.partial for r in results):
        print(f"`*`: stopped at --max-seconds={args.max_seconds:g} before --rounds were measured.")

    pooled = [t for r in results for t in r.ref_step]
    ref = _median(pooled)
    print()
    print(
        f"## step() on the training thread, against a bare training step of a 1M-param MLP "
        f"(forward + backward + SGD, batch {BATCH}, CPU): median {_secs(ref)} over all "
        f"{len(pooled)} reference steps of the run"
    )
    print()
    header = [
        "backend",
        "L",
        "P",
        "ref step here (median)",
        "snapshot calls (n, median, mean)",
        "apply calls (n, median, mean)",
        "plain calls (n, median, mean)",
        "mean, all calls",
        "overhead (< 1%)",
        f"projected mean if every due step syncs (sync_every={args.sync_every})",
        "overhead",
    ]
    rows = []
    for r in results:
        cells = []
        for kind in ("snapshot", "apply", "plain"):
            values = r.steps.get(kind, [])
            cells.append(f"{len(values)}, {_secs(_median(values))}, {_secs(_mean(values))}")
        every = [v for values in r.steps.values() for v in values]
        mean_all = _mean(every)
        # No skipped syncs: per sync_every steps, P snapshot calls and P apply calls.
        plain = _mean(r.steps.get("plain", []))
        snap = _mean(r.steps.get("snapshot", []))
        apply = _mean(r.steps["apply"]) if r.steps.get("apply") else plain
        ideal = plain + r.fragments * (snap - plain + max(apply - plain, 0.0)) / args.sync_every
        rows.append(
            [
                r.backend,
                str(r.learners),
                str(r.fragments),
                _secs(_median(r.ref_step)),
                *cells,
                _secs(mean_all),
                f"{100 * mean_all / ref:.1f}%",
                _secs(ideal),
                f"{100 * ideal / ref:.1f}%",
            ]
        )
    _table(header, rows)
    print()
    print(
        "snapshot: the call copied a due fragment for the communication thread (it may also "
        "have applied a commit); apply: it applied a staged commit (rebase) and copied "
        "nothing; plain: neither. Overheads are against the run's pooled reference median "
        "(the reference is measured before each configuration; other load on the machine "
        "moves it, see the per-configuration column). In this communication-bound run most "
        "due steps find their fragment still in flight and skip, so the measured mean is "
        "low; the projection assumes every due step syncs."
    )

    print()
    print(
        "## Where the bytes go: per learner per committed round, in fragments "
        "(lower bound: 1.00 up + 1.00 down = 2.00)"
    )
    print()
    labels = sorted({k for r in results for k in r.purposes}, key=_purpose_order)
    header = ["what (direction)", *(_config(r) for r in results)]
    rows = []
    for label in labels:
        if all(r.purposes.get(label, 0.0) / r.fragment_bytes < 0.005 for r in results):
            continue
        rows.append(
            [label, *(f"{r.purposes.get(label, 0.0) / r.fragment_bytes:.2f}" for r in results)]
        )
    small = [
        sum(v for k, v in r.purposes.items() if "(records)" in k) / r.fragment_bytes
        for r in results
    ]
    rows.append(["JSON records, all kinds", *(f"{v:.3f}" for v in small)])

    def role(r: Result, prefixes: Sequence[str]) -> float:
        picked = sum(v for k, v in r.purposes.items() if k.startswith(tuple(prefixes)))
        return picked / r.fragment_bytes

    rows.append(["= closer's work", *(f"{role(r, CLOSER_WORK):.2f}" for r in results)])
    rows.append(
        ["= every contributor's work", *(f"{role(r, CONTRIBUTOR_WORK):.2f}" for r in results)]
    )
    rows.append(["total", *(f"{sum(r.purposes.values()) / r.fragment_bytes:.2f}" for r in results)])
    rows.append(
        [
            "(recorder / counters)",
            *(f"{r.recorder_total / max(r.counters_total, 1):.3f}" for r in results),
        ]
    )
    _table(header, rows)
    print()
    print(
        "snapshot blobs: each learner's contribution (up) and the closer reading the others' "
        "(down). params / momentum blobs: the closer's commit (up); read back by the other "
        "learners' syncers (`get params (sync)`), by a closer for its own round "
        "(`by its closer`), and momentum by a closer whose cache does not hold the base "
        "round's momentum. Per learner per round = bytes over the window / (rounds x learners)."
    )

    print()
    print("## Requests per learner per committed round, by operation and key kind")
    print()
    kinds = sorted({k for r in results for k in r.requests_by})
    header = ["request", *(_config(r) for r in results)]
    rows = [[k, *(f"{r.requests_by.get(k, 0):.2f}" for r in results)] for k in kinds]
    rows.append(["total", *(f"{r.requests:.1f}" for r in results)])
    _table(header, rows)

    print()
    print("## Commit latency by phase (medians over (round, contributor) pairs)")
    print()
    names = [
        "wait for other learners",
        "close detection",
        "closer: payload transfers",
        "closer: other (records, combine, encode)",
        "syncer: sees the record",
        "syncer: params download",
        "record -> applied",
    ]
    header = ["phase", *(_config(r) for r in results)]
    rows = [["commit latency (Applied.lag_s)", *(_secs(_median(r.lag)) for r in results)]]
    rows += [[n, *(_secs(_median(r.phases.get(n, []))) for r in results)] for n in names]
    rows.append(["raw put+get of one fragment", *(_secs(r.raw) for r in results)])
    _table(header, rows)
    print()
    print(
        "From this learner's snapshot record (Published) on: until the last contributor's "
        "snapshot record; until the closer's claim; the closer's blob gets/puts, then the rest "
        "until its `rounds/` record is written; until each syncer reads that record; its "
        "params download (non-closers); until the training thread applied the commit."
    )
    print()
    for r in results:
        print(
            f"- {_config(r)}: {r.rounds} rounds in {r.seconds:.1f} s "
            f"({r.seconds / r.rounds:.2f} s/round), {r.skipped} due syncs skipped "
            "(fragment still in flight)"
        )
        for error in r.errors:
            print(f"- ERROR {_config(r)}: {error}")


# -- main ----------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="seaweedfs,filesystem")
    parser.add_argument("--learners", default="2,4", help="comma-separated learner counts")
    parser.add_argument("--fragments", default="1,4", help="comma-separated fragment counts")
    parser.add_argument("--params", default="10M", help="model size, e.g. 10M or 100M")
    parser.add_argument("--rounds", type=int, default=16, help="committed rounds measured")
    parser.add_argument("--warmup", type=int, default=3, help="training rounds before measuring")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.5, help="Session default: 0.5")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sleep per fake step")
    parser.add_argument("--reps", type=int, default=5, help="raw put+get repetitions")
    parser.add_argument("--ref-steps", type=int, default=200, help="reference training steps")
    parser.add_argument(
        "--max-seconds", type=float, default=100.0, help="per configuration, then report partial"
    )
    args = parser.parse_args()
    args.params = _parse_count(args.params)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"seaweedfs", "filesystem"}
    if unknown:
        parser.error(f"unknown backends: {sorted(unknown)}")

    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="gm-rounds-") as tmp:
        workdir = Path(tmp)
        for backend in backends:
            opener: Any = (
                seaweedfs_target(workdir) if backend == "seaweedfs" else file_target(workdir)
            )
            with opener as target:
                for learners, fragments in itertools.product(
                    _ints(args.learners), _ints(args.fragments)
                ):
                    results.append(Run(args, target, learners, fragments).execute())
    print_report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
