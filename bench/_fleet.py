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

A Moshpit fleet (``Run(algorithm=gm.Moshpit(...))``) counts group rounds instead: a round of
the window is a group round ``t``, and every group of it that closed is one closing (its
closer's successful ``group-claims/`` put to its ``group-rounds/`` record), with what that
closer downloaded in between (the other members' snapshot payloads).

``args`` (an ``argparse.Namespace``) carries: rounds, warmup, sync_every, poll_interval,
step_ms, reps (raw put + get repetitions), ref_steps (bare training steps), max_seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import math
import os
import shutil
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import gradientmail as gm
from bench import _harness as h
from bench._recorder import Op, Recorder, Registry, purpose_of, round_of
from bench._workload import BATCH, build_model, reference_step
from gradientmail import events as ev
from gradientmail import wire as p
from gradientmail.errors import ProtocolError
from testbed import s3servers

MIB = h.MIB
_progress = h.progress


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
    table.add(lag_label, *(h.secs(h.median(r.lag)) for r in results))
    for name in PHASES:
        table.add(name, *(h.secs(h.median(r.phases.get(name, []))) for r in results))
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


@contextmanager
def memory_target() -> Iterator[Target]:
    """``gm.MemoryMailbox`` (a store inside this process, no I/O): a fresh one per run. The
    raw put + get is of that store too (an event loop's calls, no threads)."""

    def open_box() -> tuple[gm.Mailbox, Callable[[], None]]:
        return gm.MemoryMailbox(f"fleet-{uuid.uuid4().hex[:8]}"), lambda: None

    def raw_put_get(data: bytes) -> float:
        box = gm.MemoryMailbox(f"raw-{uuid.uuid4().hex[:8]}")
        key = f"raw-{uuid.uuid4().hex}"

        async def both() -> bytes | None:
            await box.put_if_absent(key, data)
            return await box.get(key)

        loop = asyncio.new_event_loop()
        try:
            start = time.perf_counter()
            body = loop.run_until_complete(both())
            took = time.perf_counter() - start
        finally:
            loop.close()
        assert body is not None
        assert len(body) == len(data)
        return took

    yield Target("memory", open_box, raw_put_get)


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
    algorithm: str = "diloco"  # the algorithm's registered name
    # Per closing of the window (a DiLoCo round, or one Moshpit group), the distinct
    # snapshot payloads its closer downloaded (N-1 for DiLoCo, M-1 for a full Moshpit
    # group), and (Moshpit) the members its record lists.
    closer_snapshot_payloads: list[int] = field(default_factory=list)
    group_members: list[int] = field(default_factory=list)
    # Window deltas summed over the learners: contributions that came after their group
    # closed (Moshpit), and step()/sync() waits that gave up after their bound.
    missed_groups: int = 0
    wait_timeouts: int = 0
    # PublishFailed / RoundFailed / PollFailed events over the whole run, all learners.
    failures: int = 0
    # The busiest learner's bytes down per committed round of the window (its counters).
    busiest_down: float = 0.0
    # Committed rounds in the window (``rounds`` is at least 1: a divisor); 0 when none
    # committed within ``max_seconds``.
    committed_rounds: int = 0
    # Keys that listings returned, per learner per round of the window (listings cost
    # requests, and their bytes grow with what they list: not in the counters' bytes).
    listed_keys: float = 0.0
    # Over the whole run, drain included: claims won at attempt >= 1 (a closer's claim was
    # no longer honoured and another took over), GroupMissed events, and Moshpit group
    # records listing fewer members than ``group_size``.
    failovers: int = 0
    missed_total: int = 0
    short_groups_total: int = 0
    undrained: int = 0  # training threads still running when the drain's deadline passed


@dataclass
class Closing:
    """Per round: the start of its successful claim, the end of its rounds/ record, and its
    closer's comm-thread operations in between."""

    claim: dict[int, float] = field(default_factory=dict)
    record: dict[int, float] = field(default_factory=dict)
    ops: dict[int, list[Op]] = field(default_factory=dict)


@dataclass
class GroupClosing:
    """One Moshpit group that closed: its round and name, its closer, the start of that
    closer's successful claim, the end of its ``group-rounds/`` record, the members the
    record lists, and the closer's comm-thread operations in between."""

    round: int
    group: str
    closer: str
    claim: float
    record: float
    members: int
    ops: list[Op] = field(default_factory=list)


class ListingRecorder(Recorder):
    """:class:`~bench._recorder.Recorder` that also notes how many keys each listing
    returned: ``(end, learner, keys)`` appended to ``listed``."""

    def __init__(
        self,
        inner: gm.Mailbox,
        learner: str,
        log: list[Op],
        registry: Registry,
        listed: list[tuple[float, str, int]],
    ):
        super().__init__(inner, learner, log, registry)
        self.listed = listed

    async def list(self, prefix: str, *, after: str = "") -> Sequence[str]:
        keys = await super().list(prefix, after=after)
        self.listed.append((time.monotonic(), self.learner, len(keys)))
        return keys


class FleetRegistry(Registry):
    """:class:`~bench._recorder.Registry`, and Moshpit's group records: the payloads of
    ``group-snapshots/`` (purpose ``snapshot``), and per ``group-rounds/`` record created,
    its average's payload (``group params``), its closer and its members."""

    def __init__(self) -> None:
        super().__init__()
        self.group_closer: dict[tuple[int, str], str] = {}
        self.group_members: dict[tuple[int, str], int] = {}

    def note_put(self, learner: str, key: str, data: bytes, created: bool) -> None:
        super().note_put(learner, key, data, created)
        if key.startswith(p.GROUP_SNAPSHOTS):
            with contextlib.suppress(ProtocolError):
                snap = p.decode_snapshot(key, data)
                with self.lock:
                    self.purpose.setdefault(snap.payload, "snapshot")
        elif key.startswith(p.GROUP_ROUNDS) and created:
            with contextlib.suppress(ProtocolError):
                commit = p.decode_commit(key, data)
                t, group = p.parse_group_round_key(key)
                with self.lock:
                    if len(commit.contributors) > 1:  # alone: its own snapshot's payload
                        self.purpose.setdefault(commit.params, "group params")
                    self.group_closer[(t, group)] = learner
                    self.group_members[(t, group)] = len(commit.contributors)


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
        session_options: Mapping[str, Any] | None = None,
        drain: bool = False,
    ):
        """``algorithm``: what the learners run (default: ``gm.DiLoCo(sync_every=
        args.sync_every, fragments=fragments)``); ``label`` names it in progress lines;
        ``session_options``: more keyword arguments of every ``gm.Session`` (e.g.
        ``round_timeout``). ``drain``: at the end, every learner trains on to the same step
        count, the highest any had started, instead of stopping where it is, so that every
        round one of them contributed to gets its other contributions (with ``sync_every=1``
        the step count is the round number): none waits out ``round_timeout`` for a learner
        that stopped before it."""
        self.args = args
        self.algorithm = algorithm
        self.label = label
        self.session_options = dict(session_options or {})
        self.drain = drain
        self._drain_to: int | None = None  # draining: the step count every learner trains to
        self._highest = 0  # the highest step count a learner started
        self.listed: list[tuple[float, str, int]] = []
        self.params = params
        # Rounds of P fragments carry 1/P of the model each: measure more of them (twice as
        # many when P > 1), so the window holds whole cycles of fragments.
        self.rounds = args.rounds * min(fragments, 2)
        self.target = target
        self.n = learners
        self.p = fragments
        self.log: list[Op] = []
        self.registry = FleetRegistry()
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
        due = _due_fragment(session.algorithm)
        try:
            while True:
                if not self.drain:
                    if self.stop.is_set():
                        break
                else:
                    with self.lock:  # a learner that started a step is within _drain_to
                        if self._drain_to is not None and session.steps >= self._drain_to:
                            break
                        self._highest = max(self._highest, session.steps + 1)
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
                mailbox=ListingRecorder(box, learner_id, self.log, self.registry, self.listed),
                learner_id=learner_id,
                poll_interval=args.poll_interval,
                on_event=relay,
                **self.session_options,
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
        if t0 is None or r0 is None or (self.drain and r1 == r0):
            # Never warmed up, or (draining runs) no round committed after the warm-up
            # within max_seconds: measure all of it, the warm-up round included.
            c0 = [ev.Counters() for _ in learners]
            t0, r0 = started, self.p - 1
            cpu0 = cpu_started
        if self.drain:
            with self.lock:
                self._drain_to = self._highest
            _progress(f"{name}: draining to step {self._drain_to}")
        self.stop.set()
        drain_end = time.monotonic() + float(getattr(args, "drain_seconds", 60.0))
        for thread in threads:
            # Draining: one deadline for all (a stuck round would cost 30 s per thread).
            thread.join(timeout=max(0.0, drain_end - time.monotonic()) if self.drain else 30)
        undrained = sum(thread.is_alive() for thread in threads)
        if undrained:
            _progress(f"{name}: {undrained} training threads still in step()")

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
        result.algorithm = algorithm.name
        result.undrained = undrained
        result.failures = sum(
            isinstance(e, ev.PublishFailed | ev.RoundFailed | ev.PollFailed)
            for x in learners
            for _, e in x.events
        )
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

        def total(name: str) -> int:
            pairs = zip(c0, c1, strict=True)
            return int(sum(getattr(b, name) - getattr(a, name) for a, b in pairs))

        busiest_down = max(
            (
                sum(b.bytes_down.values()) - sum(a.bytes_down.values())
                for a, b in zip(c0, c1, strict=True)
            ),
            default=0,
        )

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
                closes += op.op == "put" and op.key.startswith(("rounds/", p.GROUP_ROUNDS))
                label = purpose_of(op, self.registry)
                if op.up:
                    purposes[f"{label} [up]"] += op.up
                if op.down:
                    purposes[f"{label} [down]"] += op.down
                recorded += op.up + op.down
        closing = self._closing()
        closed = [r for r in window if r in closing.claim and r in closing.record]
        # What each closing's closer did between its claim and its record: per DiLoCo round,
        # or per Moshpit group of the window's group rounds.
        closings: list[list[Op]] = [closing.ops.get(r, []) for r in closed]
        seconds = [closing.record[r] - closing.claim[r] for r in closed]
        members: list[int] = []
        if isinstance(self.algorithm, gm.Moshpit):
            groups = [g for g in self._group_closing() if g.round in window]
            closings = [g.ops for g in groups]
            seconds = [g.record - g.claim for g in groups]
            members = [g.members for g in groups]
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
            raw=h.median(raw),
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
            closer_down=[self._down(ops) for ops in closings],
            closer_snapshot_down=[self._down(ops, "snapshot") for ops in closings],
            closer_momentum_down=[self._down(ops, "momentum") for ops in closings],
            closer_seconds=seconds,
            closer_snapshot_payloads=[self._payloads(ops, "snapshot") for ops in closings],
            group_members=members,
            missed_groups=sum(
                1
                for x in learners
                for _, e in x.events
                if isinstance(e, ev.GroupMissed) and e.round in window
            ),
            missed_total=sum(
                1 for x in learners for _, e in x.events if isinstance(e, ev.GroupMissed)
            ),
            short_groups_total=self._short_groups(),
            failovers=self._failovers(),
            committed_rounds=max(0, r1 - r0),
            listed_keys=sum(k for at, _, k in self.listed if t0 <= at <= t1) / per,
            wait_timeouts=total("wait_timeouts"),
            busiest_down=busiest_down / rounds,
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

    def _group_closing(self) -> list[GroupClosing]:
        """Every Moshpit group that closed: its closer's successful claim (the last one it
        won), its ``group-rounds/`` record and the closer's comm-thread operations between
        the two."""
        registry = self.registry
        assert isinstance(registry, FleetRegistry)
        claims: dict[tuple[int, str], dict[str, float]] = defaultdict(dict)
        records: dict[tuple[int, str], float] = {}
        comm: dict[str, list[Op]] = defaultdict(list)
        for op in self.log:
            if op.thread == "comm":
                comm[op.learner].append(op)
            if op.op != "put" or not op.ok:
                continue
            if op.key.startswith(p.GROUP_CLAIMS):
                parts = op.key.split("/")
                if len(parts) == 4 and parts[1].isdigit():
                    claims[(int(parts[1]), parts[2])][op.learner] = op.start
            elif op.key.startswith(p.GROUP_ROUNDS):
                with contextlib.suppress(ProtocolError):
                    records[p.parse_group_round_key(op.key)] = op.end
        found: list[GroupClosing] = []
        for (t, group), end in sorted(records.items()):
            closer = registry.group_closer.get((t, group))
            start = claims.get((t, group), {}).get(closer or "")
            if closer is None or start is None:
                continue
            ops = [o for o in comm[closer] if start <= o.start <= o.end <= end]
            found.append(
                GroupClosing(
                    t, group, closer, start, end, registry.group_members.get((t, group), 0), ops
                )
            )
        return found

    def _failovers(self) -> int:
        """Claims (of rounds or of groups) won at attempt >= 1, over the whole run."""
        won = 0
        for op in self.log:
            if op.op != "put" or not op.ok:
                continue
            round_claim = op.key.startswith(p.CLAIMS) and round_of(op.key) is not None
            if round_claim or op.key.startswith(p.GROUP_CLAIMS):
                with contextlib.suppress(ProtocolError):
                    won += p.parse_claim_attempt(op.key) >= 1
        return won

    def _short_groups(self) -> int:
        """Moshpit group records, over the whole run, listing fewer than M members."""
        if not isinstance(self.algorithm, gm.Moshpit):
            return 0
        registry = self.registry
        assert isinstance(registry, FleetRegistry)
        m = self.algorithm.group_size
        return sum(1 for members in registry.group_members.values() if members < m)

    def _down(self, ops: Sequence[Op], purpose: str | None = None) -> float:
        """Bytes ``ops`` downloaded (of blobs of ``purpose`` when given)."""
        return float(
            sum(
                o.down
                for o in ops
                if purpose is None
                or self.registry.purpose.get(self.registry.payload(o.key)) == purpose
            )
        )

    def _payloads(self, ops: Sequence[Op], purpose: str) -> int:
        """How many distinct payloads of ``purpose`` ``ops`` downloaded (parts count as
        their payload)."""
        return len(
            {
                self.registry.payload(o.key)
                for o in ops
                if o.op == "get"
                and o.down
                and self.registry.purpose.get(self.registry.payload(o.key)) == purpose
            }
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


def _due_fragment(algorithm: Any) -> Callable[[int], int | None]:
    """The fragment due after local step ``step`` (1-based): the algorithm's own
    ``due_fragment`` (DiLoCo's), else from its ``offset``s (Moshpit's one fragment)."""
    own = getattr(algorithm, "due_fragment", None)
    if own is not None:
        return own  # type: ignore[no-any-return]
    offsets = {algorithm.offset(f): f for f in range(algorithm.fragments)}
    every = int(algorithm.sync_every)
    return lambda step: offsets.get(step % every)


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
