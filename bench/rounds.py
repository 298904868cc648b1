"""Benchmark 3 — round cost per learner: bytes, requests and commit latency per committed
round, against the byte lower bound and the raw transfer of the same bytes on the same store,
measured in the same run.

Several learners (threads of this process, each with its own model copy and its own
``gm.Session``) train a model of ``--params`` float32 parameters with a cheap fake step (a
little noise added to every tensor, then a short sleep standing in for accelerator time), so
the run is communication-bound. One mailbox per configuration: SeaweedFS (started fresh by
this benchmark, one prefix per configuration) or ``gm.FileMailbox`` in a temporary
directory. After ``--warmup`` training rounds, ``--rounds`` committed rounds are measured
(twice as many with P > 1 fragments: a round of P fragments carries 1/P of the model).

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

A recording wrapper under each session's mailbox (``_recorder.py``) attributes every byte
to what it carried (snapshot / params / momentum payloads, JSON records) and every round's
latency to its phases (waiting for the other learners, close detection, closer work,
syncer).

Targets: <= 1.2x the byte lower bound, <= 2x the raw transfer time.

    .venv/bin/python -m bench rounds [--quick | --large]
    .venv/bin/python bench/rounds.py [--backends seaweedfs,filesystem] [--learners 2,4]
        [--fragments 1,4] [--params 10M] [--rounds 8] [--warmup 2] [--sync-every 8]
        [--poll-interval 0.5] [--step-ms 5] [--max-seconds 60]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import shutil
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import gradientmail as gm
from bench import _harness as h
from bench._recorder import Op, Recorder, Registry, purpose_of, round_of
from bench._workload import BATCH, build_model, reference_step
from gradientmail import events as ev
from tests.support import s3servers

NAME = "rounds"
MIB = h.MIB
_progress = h.progress


def _median(values: Sequence[float]) -> float:
    return h.Stats.of(values).median


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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
            box = server.mailbox(prefix)
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
    def __init__(
        self,
        args: argparse.Namespace,
        target: Target,
        learners: int,
        fragments: int,
        params: int,
    ):
        self.args = args
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
        base = build_model(self.params, self.p)
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
            r = round_of(op.key)
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
            transfer = _covered(
                [(o.start, o.end) for o in closer_ops[r] if o.key.startswith("blobs/")]
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
                get = params_get.get((r, learner))
                if get is not None:
                    phases["syncer: params download"].append(get.end - get.start)
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


# -- the report ------------------------------------------------------------------------------


def _purpose_order(label: str) -> tuple[int, str]:
    order = ("put snapshot", "put params", "put momentum", "get snapshot", "get params")
    for i, prefix in enumerate((*order, "get momentum")):
        if label.startswith(prefix) and "(records)" not in label:
            return (i, label)
    return (len(order) + 1, label)


def _config(r: Result) -> str:
    return f"{r.backend} L={r.learners} P={r.fragments} {r.params / 1e6:.0f}M"


CLOSER_WORK = ("put params", "put momentum", "get snapshot", "get momentum", "get params (by")
CONTRIBUTOR_WORK = ("put snapshot", "get params (sync)")
PHASES = [
    "wait for other learners",
    "close detection",
    "closer: payload transfers",
    "closer: other (records, combine, encode)",
    "syncer: sees the record",
    "syncer: params download",
    "record -> applied",
]


def star_floor(learners: int) -> float:
    """Bytes per learner per round, in fragments, of a round closed by one learner with no
    momentum blob: each uploads its snapshot; the closer downloads the L-1 others and uploads
    the result; the L-1 others download it: (L + 1 + 2(L-1)) / L = 3 - 1/L."""
    return 3 - 1 / learners


def build_report(results: list[Result], args: argparse.Namespace) -> h.Report:
    report = h.Report(
        NAME,
        "3. Round cost per learner: bytes, requests, commit latency",
        "the byte lower bound (one fragment up + one down per learner per round) and a raw "
        "put + get of one fragment on the same store, measured in this run",
    )
    table = report.table(
        f"Per learner per committed round (sync_every={args.sync_every}, poll_interval="
        f"{args.poll_interval} s, fake step {args.step_ms:g} ms)",
        [
            "backend",
            "L",
            "P",
            "params",
            "rounds",
            "up+down / learner / round",
            "lower bound",
            "ratio (<= 1.2)",
            "floor of 1 closer",
            "requests / round",
            "commit latency (median)",
            "raw put+get",
            "ratio (<= 2)",
            "closes / round",
        ],
        note=(
            "Lower bound: one fragment up + one down (fragment = parameter bytes / fragments). "
            "Floor of 1 closer: what any protocol in which one learner downloads the others' "
            "snapshots and uploads the result moves, averaged over learners, without a "
            "momentum blob: (3 - 1/L)/2 x the bound. Raw put+get: one fragment, boto3 "
            "put_object + get_object (SeaweedFS) or write + fsync + read (filesystem), median "
            "of --reps. `closes / round`: puts of the `rounds/` record per committed round."
            + (
                f" `*`: stopped at --max-seconds={args.max_seconds:g} before --rounds."
                if any(r.partial for r in results)
                else ""
            )
        ),
    )
    rows_json = []
    for r in results:
        bound = 2 * r.fragment_bytes
        lag = _median(r.lag)
        table.add(
            r.backend,
            r.learners,
            r.fragments,
            f"{r.params / 1e6:.1f}M",
            f"{r.rounds}{'*' if r.partial else ''}",
            h.size(r.up_down),
            h.size(bound),
            h.ratio(r.up_down, bound),
            f"{star_floor(r.learners) / 2:.2f}x",
            f"{r.requests:.1f}",
            h.secs(lag),
            h.secs(r.raw),
            h.ratio(lag, r.raw, 1),
            f"{r.closes:.2f}",
        )
        rows_json.append(
            {
                "config": _config(r),
                "backend": r.backend,
                "learners": r.learners,
                "fragments": r.fragments,
                "params": r.params,
                "rounds": r.rounds,
                "partial": r.partial,
                "bytes_per_learner_round": r.up_down,
                "bytes_ratio": r.up_down / bound,
                "requests_per_learner_round": r.requests,
                "latency_median_s": lag,
                "latency_s": h.Stats.of(r.lag).__dict__,
                "raw_put_get_s": r.raw,
                "latency_ratio": lag / r.raw,
                "closes_per_round": r.closes,
                "bytes_by_purpose": r.purposes,
                "requests_by": r.requests_by,
                "phases_median_s": {k: _median(v) for k, v in r.phases.items()},
                "step_s": {k: h.Stats.of(v).__dict__ for k, v in r.steps.items()},
                "skipped_syncs": r.skipped,
                "errors": r.errors,
            }
        )

    pooled = [t for r in results for t in r.ref_step]
    ref = _median(pooled)
    table = report.table(
        f"step() on the training thread (fake training), against a bare step of the 1M-param "
        f"MLP (batch {BATCH}, CPU): median {h.secs(ref)} over {len(pooled)} steps",
        [
            "config",
            "snapshot calls (n, median)",
            "apply calls (n, median)",
            "plain calls (n, median)",
            "mean, all calls",
            "vs bare step",
        ],
        note=(
            "Learners are threads of one process here, so calls also wait for the GIL; "
            "benchmark 4 measures step() in processes of their own."
        ),
    )
    for r in results:
        cells = [
            f"{len(r.steps.get(k, []))}, {h.secs(_median(r.steps.get(k, [])))}"
            for k in ("snapshot", "apply", "plain")
        ]
        every = [v for values in r.steps.values() for v in values]
        table.add(_config(r), *cells, h.secs(_mean(every)), h.pct(_mean(every), ref))

    labels = sorted({k for r in results for k in r.purposes}, key=_purpose_order)
    table = report.table(
        "Where the bytes go: per learner per committed round, in fragments "
        "(lower bound: 1.00 up + 1.00 down = 2.00)",
        ["what (direction)", *(_config(r) for r in results)],
        note=(
            "snapshot blobs: each learner's contribution (up) and the closer reading the "
            "others' (down). params / momentum blobs: the closer's commit (up); read back by "
            "the other learners' syncers (`get params (sync)`), by a closer for its own round "
            "(`by its closer`), and momentum by a closer whose cache does not hold the base "
            "round's momentum."
        ),
    )
    for label in labels:
        if all(r.purposes.get(label, 0.0) / r.fragment_bytes < 0.005 for r in results):
            continue
        table.add(label, *(f"{r.purposes.get(label, 0.0) / r.fragment_bytes:.2f}" for r in results))
    small = [
        sum(v for k, v in r.purposes.items() if "(records)" in k) / r.fragment_bytes
        for r in results
    ]
    table.add("JSON records, all kinds", *(f"{v:.3f}" for v in small))

    def role(r: Result, prefixes: Sequence[str]) -> float:
        picked = sum(v for k, v in r.purposes.items() if k.startswith(tuple(prefixes)))
        return picked / r.fragment_bytes

    table.add("= closer's work", *(f"{role(r, CLOSER_WORK):.2f}" for r in results))
    table.add("= every contributor's work", *(f"{role(r, CONTRIBUTOR_WORK):.2f}" for r in results))
    table.add("total", *(f"{sum(r.purposes.values()) / r.fragment_bytes:.2f}" for r in results))
    table.add(
        "(recorder / counters)",
        *(f"{r.recorder_total / max(r.counters_total, 1):.3f}" for r in results),
    )

    kinds = sorted({k for r in results for k in r.requests_by})
    table = report.table(
        "Requests per learner per committed round, by operation and key kind",
        ["request", *(_config(r) for r in results)],
    )
    for k in kinds:
        table.add(k, *(f"{r.requests_by.get(k, 0):.2f}" for r in results))
    table.add("total", *(f"{r.requests:.1f}" for r in results))

    table = report.table(
        "Commit latency by phase (medians over (round, contributor) pairs)",
        ["phase", *(_config(r) for r in results)],
        note=(
            "From this learner's snapshot record (Published) on: until the last contributor's "
            "snapshot record; until the closer's claim; the closer's blob gets/puts, then the "
            "rest until its `rounds/` record is written; until each syncer reads that record; "
            "its params download (non-closers); until the training thread applied the commit."
        ),
    )
    table.add("commit latency (Applied.lag_s)", *(h.secs(_median(r.lag)) for r in results))
    for name in PHASES:
        table.add(name, *(h.secs(_median(r.phases.get(name, []))) for r in results))
    table.add("raw put+get of one fragment", *(h.secs(r.raw) for r in results))

    for r in results:
        report.notes.append(
            f"{_config(r)}: {r.rounds} rounds in {r.seconds:.1f} s "
            f"({r.seconds / r.rounds:.2f} s/round), {r.skipped} due syncs skipped "
            "(fragment still in flight)"
        )
        for error in r.errors:
            report.notes.append(f"ERROR {_config(r)}: {error}")

    for backend in dict.fromkeys(r.backend for r in results):
        mine = [r for r in results if r.backend == backend]
        worst_bytes = max(mine, key=lambda r: r.up_down / (2 * r.fragment_bytes))
        b_ratio = worst_bytes.up_down / (2 * worst_bytes.fragment_bytes)
        best_floor = min(star_floor(r.learners) / 2 for r in mine)
        report.target(
            f"bytes per learner per round vs the lower bound, {backend}",
            f"{b_ratio:.2f}x at worst ({_config(worst_bytes)}); best "
            f"{min(r.up_down / (2 * r.fragment_bytes) for r in mine):.2f}x",
            "<= 1.2x",
            b_ratio <= 1.2,
            (
                "Averaged over learners, a round closed by one learner cannot go below "
                f"(3 - 1/L)/2 x the bound ({best_floor:.2f}x at L={min(r.learners for r in mine)}"
                "): the closer downloads L-1 snapshots and uploads the result, the others "
                "download it. On top: the momentum blob (1/L fragment up per learner) and "
                "momentum downloads by a closer whose cache misses (see the bytes table). A "
                "contributor that does not close moves exactly the bound (1 up, 1 down)"
            ),
        )
        worst_lag = max(mine, key=lambda r: _median(r.lag) / r.raw)
        l_ratio = _median(worst_lag.lag) / worst_lag.raw
        sees = [_median(r.phases.get("syncer: sees the record", [])) for r in mine]
        report.target(
            f"commit latency vs raw put+get of one fragment, {backend}",
            f"{l_ratio:.1f}x at worst ({_config(worst_lag)}: {h.secs(_median(worst_lag.lag))} "
            f"vs {h.secs(worst_lag.raw)}); best "
            f"{min(_median(r.lag) / r.raw for r in mine):.1f}x",
            "<= 2x",
            l_ratio <= 2,
            (
                "See the phase table: the syncer learns of a commit by polling every "
                f"poll_interval={args.poll_interval} s (median wait until it sees the record: "
                f"{h.secs(_median(sees))}), and the closer downloads, combines, encodes and "
                "uploads (params and momentum) one after another"
            ),
        )
    report.data = {"args": vars(args), "configs": rows_json}
    return report


# -- running ---------------------------------------------------------------------------------


def defaults(ctx: h.Context) -> argparse.Namespace:
    """The preset's arguments (``--quick``: one learner count, fewer rounds)."""
    return argparse.Namespace(
        backends=["seaweedfs", "filesystem"],
        learners=ctx.pick([2, 4], [2], [2, 4, 8]),
        fragments=[1, 4],
        params=ctx.pick([10_000_000], [10_000_000], [10_000_000, 100_000_000]),
        rounds=ctx.pick(8, 3, 12),
        warmup=ctx.pick(2, 1, 3),
        sync_every=8,
        poll_interval=0.5,
        step_ms=5.0,
        reps=ctx.pick(5, 3),
        ref_steps=ctx.pick(100, 50),
        max_seconds=ctx.pick(60.0, 20.0, 150.0),
    )


def run(ctx: h.Context) -> h.Report:
    args = ctx.options.get(NAME, {}).get("args") or defaults(ctx)
    results: list[Result] = []
    workdir = ctx.workdir / f"rounds-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    for backend in args.backends:
        opener: Any = seaweedfs_target(workdir) if backend == "seaweedfs" else file_target(workdir)
        with opener as target:
            for params, learners, fragments in itertools.product(
                args.params, args.learners, args.fragments
            ):
                results.append(Run(args, target, learners, fragments, params).execute())

    return build_report(results, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="seaweedfs,filesystem")
    parser.add_argument("--learners", default="2,4", help="comma-separated learner counts")
    parser.add_argument("--fragments", default="1,4", help="comma-separated fragment counts")
    parser.add_argument("--params", default="10M", help="model sizes, e.g. 10M,100M")
    parser.add_argument("--rounds", type=int, default=8, help="committed rounds measured")
    parser.add_argument("--warmup", type=int, default=2, help="training rounds before measuring")
    parser.add_argument("--sync-every", type=int, default=8)
    parser.add_argument("--poll-interval", type=float, default=0.5, help="Session default: 0.5")
    parser.add_argument("--step-ms", type=float, default=5.0, help="sleep per fake step")
    parser.add_argument("--reps", type=int, default=5, help="raw put+get repetitions")
    parser.add_argument("--ref-steps", type=int, default=100, help="reference training steps")
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="per configuration, then report partial"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON record")
    args = parser.parse_args()
    args.params = [h.count(x) for x in args.params.split(",") if x.strip()]
    args.learners = _ints(args.learners)
    args.fragments = _ints(args.fragments)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"seaweedfs", "filesystem"}
    if unknown:
        parser.error(f"unknown backends: {sorted(unknown)}")
    json_path = args.json
    del args.json
    from bench.__main__ import run_suite

    return run_suite([NAME], options={NAME: {"args": args}}, json_path=json_path)


if __name__ == "__main__":
    sys.exit(main())
