"""The engine of benchmarks 3 (``rounds``) and 7 (``scale``): a fleet of learners (threads of
this process, each with its own model copy and its own ``gm.Session``) training with a cheap
fake step on one mailbox, and what a window of committed rounds cost them.

:class:`Run` starts ``learners`` sessions on a :class:`Target` (SeaweedFS, or
``gm.FileMailbox`` in a temporary directory), lets them train until ``args.warmup`` rounds
committed, measures ``args.rounds`` committed rounds (at most ``args.max_seconds``), and
returns a :class:`Result`: bytes and requests per learner per round (window deltas of
``session.counters()``), commit latency (``Applied.lag_s``), time inside ``step()``, and from
the recording mailbox (``_recorder.py``) bytes by purpose, latency by phase and, per round,
what its closer downloaded and how long it took from its claim to its ``rounds/`` record.

``args`` (an ``argparse.Namespace``) carries: rounds, warmup, sync_every, poll_interval,
step_ms, reps (raw put + get repetitions), ref_steps (bare training steps), max_seconds.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import shutil
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gradientmail as gm
from bench import _harness as h
from bench._recorder import Op, Recorder, Registry, purpose_of, round_of
from bench._workload import BATCH, build_model, reference_step
from gradientmail import events as ev
from tests.support import s3servers

MIB = h.MIB
_progress = h.progress


def median(values: Sequence[float]) -> float:
    return h.Stats.of(values).median


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


# The phases Run._phases splits a commit's latency into, in the order they happen.
PHASES = [
    "wait for other learners",
    "close detection",
    "closer: payload transfers",
    "closer: other (records, combine, encode)",
    "syncer: sees the record",
    "syncer: params download",
    "record -> applied",
]


def phase_table(
    report: h.Report, results: Sequence[Result], columns: Sequence[str], lag_label: str, note: str
) -> h.Table:
    """The commit-latency-by-phase table (medians per result), for more rows to be added."""
    table = report.table(
        "Commit latency by phase (medians over (round, contributor) pairs)",
        ["phase", *columns],
        note=note,
    )
    table.add(lag_label, *(h.secs(median(r.lag)) for r in results))
    for name in PHASES:
        table.add(name, *(h.secs(median(r.phases.get(name, []))) for r in results))
    return table


# -- targets -------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    open_box: Callable[[], tuple[gm.Mailbox, Callable[[], None]]]  # fresh run -> (box, cleanup)
    raw_put_get: Callable[[bytes], float]  # seconds for a raw put + get of these bytes


@contextmanager
def seaweedfs_target(workdir: Path, prefix: str = "rounds") -> Iterator[Target]:
    """A fresh SeaweedFS server; each run gets a prefix of its own in one bucket."""
    _progress("starting SeaweedFS")
    with s3servers.seaweedfs(workdir / "seaweedfs") as server:
        client = server.client()

        def open_box() -> tuple[gm.Mailbox, Callable[[], None]]:
            box = server.mailbox(f"{prefix}-{uuid.uuid4().hex[:8]}")
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
    """``gm.FileMailbox`` in a fresh directory under ``workdir`` per run."""
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
    cpu_seconds: float = 0.0  # this process's CPU time (all threads) over the window
    # Per committed round of the window (in round order), its closer's work on its comm
    # thread from its successful claim to its rounds/ record: every byte it downloaded, the
    # snapshot and momentum blobs among them, and the seconds from claim to record.
    closer_down: list[float] = field(default_factory=list)
    closer_snapshot_down: list[float] = field(default_factory=list)
    closer_momentum_down: list[float] = field(default_factory=list)
    closer_seconds: list[float] = field(default_factory=list)
    # Window deltas of ``session.counters()`` per learner per committed round: bytes up and
    # down (all key kinds), the same by key kind, and commits applied / computed from their
    # contributions (SparseLoCo) instead of downloaded.
    up: float = 0.0
    down: float = 0.0
    up_by_kind: dict[str, float] = field(default_factory=dict)
    down_by_kind: dict[str, float] = field(default_factory=dict)
    applied: float = 0.0
    computed: float = 0.0
    label: str = ""  # the algorithm's label when the run was given one (Run(label=))


@dataclass
class Closing:
    """Per round: the start of its successful claim, the end of its rounds/ record, and its
    closer's comm-thread operations in between."""

    claim: dict[int, float] = field(default_factory=dict)
    record: dict[int, float] = field(default_factory=dict)
    ops: dict[int, list[Op]] = field(default_factory=dict)


class Run:
    def __init__(
        self,
        args: argparse.Namespace,
        target: Target,
        learners: int,
        fragments: int,
        params: int,
        *,
        algorithm: gm.Algorithm | None = None,
        label: str = "",
    ):
        """``algorithm``: what the learners run (default: ``gm.DiLoCo(sync_every=
        args.sync_every, fragments=fragments)``); ``label`` names it in progress lines."""
        self.args = args
        self.algorithm = algorithm
        self.label = label
        self.params = params
        # Rounds of P fragments carry 1/P of the model each: measure more of them (twice as
        # many when P > 1), so the window holds whole cycles of fragments.
        self.rounds = args.rounds * min(fragments, 2)
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
        if self.label:
            name = f"{name} {self.label}"
        base = build_model(self.params, self.p)
        total_params = sum(x.numel() for x in base.parameters())
        param_bytes = sum(x.numel() * x.element_size() for x in base.parameters())
        fragment_bytes = param_bytes / self.p
        algorithm = self.algorithm or gm.DiLoCo(sync_every=args.sync_every, fragments=self.p)

        ref_step: list[float] = []
        if args.ref_steps:
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
        cpu_started = cpu0 = time.process_time()
        for thread in threads:
            thread.start()

        warm_until = self.p - 1 + args.warmup * self.p
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
                cpu0 = time.process_time()
            if t0 is not None and r0 is not None and newest >= r0 + self.rounds:
                break
            if now > deadline:
                partial = True
                break
            if any(x.error for x in learners):
                break
            if now - last_note > 5:
                last_note = now
                done = 0 if r0 is None else newest - r0
                phase = "warm-up" if r0 is None else f"{done}/{self.rounds} measured"
                _progress(f"{name}: round {newest} ({phase}, {now - started:.0f} s)")
        c1 = [x.session.counters() for x in learners]
        t1 = time.monotonic()
        cpu1 = time.process_time()
        with self.lock:
            r1 = self.committed
        if t0 is None or r0 is None:  # never warmed up: measure all of it
            c0 = [ev.Counters() for _ in learners]
            t0, r0 = started, self.p - 1
            cpu0 = cpu_started
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
        result.cpu_seconds = cpu1 - cpu0
        result.label = self.label
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

        def by_kind(name: str) -> dict[str, float]:
            kinds: Counter[str] = Counter()
            for a, b in zip(c0, c1, strict=True):
                before, after = getattr(a, name), getattr(b, name)
                for key, value in after.items():
                    kinds[key] += value - before.get(key, 0)
            return {k: v / per for k, v in kinds.items()}

        def count(name: str) -> float:
            done = sum(getattr(b, name) - getattr(a, name) for a, b in zip(c0, c1, strict=True))
            return float(done) / per

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
        closing = self._closing()
        closed = [r for r in window if r in closing.claim and r in closing.record]
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
            raw=median(raw),
            steps=dict(steps),
            purposes={k: v / per for k, v in purposes.items()},
            requests_by={k: v / per for k, v in requests_by.items()},
            phases=self._phases(learners, window, closing),
            partial=partial,
            skipped=skipped,
            errors=errors,
            counters_total=(delta("bytes_up") + delta("bytes_down")),
            recorder_total=float(recorded),
            closes=closes / rounds,
            closer_down=[self._closer_down(closing, r) for r in closed],
            closer_snapshot_down=[self._closer_down(closing, r, "snapshot") for r in closed],
            closer_momentum_down=[self._closer_down(closing, r, "momentum") for r in closed],
            closer_seconds=[closing.record[r] - closing.claim[r] for r in closed],
            up=delta("bytes_up") / per,
            down=delta("bytes_down") / per,
            up_by_kind=by_kind("bytes_up"),
            down_by_kind=by_kind("bytes_down"),
            applied=count("applied"),
            computed=count("computed"),
        )

    def _closing(self) -> Closing:
        """Each round's successful claim, its rounds/ record, and its closer's comm-thread
        operations between the two."""
        closing = Closing()
        for op in self.log:
            r = round_of(op.key)
            if r is None or op.op != "put" or not op.ok:
                continue
            if op.key.startswith("claims/"):
                closing.claim[r] = op.start
            elif op.key.startswith("rounds/"):
                closing.record[r] = op.end
        comm: dict[str, list[Op]] = defaultdict(list)
        for op in self.log:
            if op.thread == "comm":
                comm[op.learner].append(op)
        for r, start in closing.claim.items():
            end = closing.record.get(r)
            closer = self.registry.closer.get(r)
            if end is None or closer is None:
                continue
            closing.ops[r] = [o for o in comm[closer] if start <= o.start <= o.end <= end]
        return closing

    def _closer_down(self, closing: Closing, r: int, purpose: str | None = None) -> float:
        """Bytes round ``r``'s closer downloaded from claim to record (blobs of ``purpose``)."""
        return float(
            sum(
                o.down
                for o in closing.ops.get(r, [])
                if purpose is None
                or self.registry.purpose.get(self.registry.payload(o.key)) == purpose
            )
        )

    def _phases(
        self, learners: list[Learner], window: range, closing: Closing
    ) -> dict[str, list[float]]:
        """Split each (round, contributor) latency into the phases it went through."""
        published: dict[tuple[int, str], float] = {}
        claim, record, closer_ops = closing.claim, closing.record, closing.ops
        round_seen: dict[tuple[int, str], float] = {}
        params_get: dict[tuple[int, str], list[Op]] = defaultdict(list)  # index and parts
        round_by_params = self.registry.params_round
        for op in self.log:
            r = round_of(op.key)
            if op.op == "put" and op.key.startswith("snapshots/") and r is not None:
                published[(r, op.learner)] = op.end
            elif op.op == "get" and op.key.startswith("rounds/") and op.thread == "sync":
                if r is not None:
                    round_seen.setdefault((r, op.learner), op.start)
            elif op.op == "get" and op.thread == "sync":
                payload = self.registry.payload(op.key)
                if payload in round_by_params:
                    params_get[(round_by_params[payload], op.learner)].append(op)
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
            transfer = _covered(
                [(o.start, o.end) for o in closer_ops.get(r, []) if o.key.startswith("blobs/")]
            )
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
                gets = params_get.get((r, learner))
                if gets:
                    phases["syncer: params download"].append(
                        max(o.end for o in gets) - min(o.start for o in gets)
                    )
                phases["record -> applied"].append(applied[(r, learner)] - record[r])
        return dict(phases)


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``intervals`` (overlapping transfers count once)."""
    total = 0.0
    end = -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
