"""The engine of ``rounds`` and ``scale``: a fleet of learners (threads of this process, each
with its own model copy and ``gm.Session``) training with a cheap fake step on one store
(``mailbox.target``), and what a window of committed rounds cost them.

:class:`Run` trains until ``args.warmup`` rounds committed, measures ``args.rounds`` committed
rounds (at most ``args.max_seconds``) and returns a :class:`Result`: window deltas of
``session.counters()``, commit latency (``Applied.lag_s``), time inside ``step()``, and from
the recording mailbox (``_recorder.py``) bytes by purpose, latency by phase and what each
closing's closer downloaded between its claim and its record. A Moshpit fleet counts group
rounds; each group that closed is one closing.

``args`` carries: rounds, warmup, sync_every, poll_interval, step_ms, reps (raw put + get
repetitions), ref_steps (bare training steps), max_seconds, and optionally drain_seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import gradientmail as gm
from bench import _harness as h
from bench._recorder import Op, Recorder, Registry, purpose_of, round_of
from bench._workload import BATCH, build_model, reference_step
from bench.mailbox import Target
from gradientmail import events as ev
from gradientmail import wire as p
from gradientmail.errors import ProtocolError

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


@dataclass
class Learner:
    learner_id: str
    session: gm.Session
    events: list[tuple[float, ev.Event]] = field(default_factory=list)
    steps: list[tuple[float, str, float]] = field(default_factory=list)  # seconds, kind, at
    error: BaseException | None = None


@dataclass
class Result:
    backend: str
    learners: int
    fragments: int
    params: int
    fragment_bytes: float
    rounds: int  # committed rounds in the window, at least 1 (a divisor)
    seconds: float
    up_down: float  # bytes per learner per round
    requests: float  # per learner per round
    lag: list[float]
    raw: float  # seconds, median raw put + get of one fragment
    steps: dict[str, list[float]]  # step() seconds by kind: snapshot, apply, plain
    purposes: dict[str, float]  # bytes per learner per round by purpose
    requests_by: dict[str, float]  # per learner per round by op:kind
    phases: dict[str, list[float]]
    partial: bool
    skipped: int
    errors: list[str]
    counters_total: float = 0.0
    recorder_total: float = 0.0
    closes: float = 0.0  # puts of rounds/ records per committed round
    ref_step: list[float] = field(default_factory=list)  # bare 1M-param training steps
    cpu_seconds: float = 0.0  # this process's CPU time (all threads) over the window
    # Per closing of the window (a DiLoCo round, or one Moshpit group): what its closer
    # downloaded on its comm thread between its successful claim and its record (all, the
    # snapshot and momentum blobs), the seconds in between, the distinct snapshot payloads
    # read, and (Moshpit) the members its record lists.
    closer_down: list[float] = field(default_factory=list)
    closer_snapshot_down: list[float] = field(default_factory=list)
    closer_momentum_down: list[float] = field(default_factory=list)
    closer_seconds: list[float] = field(default_factory=list)
    closer_snapshot_payloads: list[int] = field(default_factory=list)
    group_members: list[int] = field(default_factory=list)
    # Counters' window deltas per learner per round: bytes (all, by key kind), commits
    # applied and computed from contributions (SparseLoCo).
    up: float = 0.0
    down: float = 0.0
    up_by_kind: dict[str, float] = field(default_factory=dict)
    down_by_kind: dict[str, float] = field(default_factory=dict)
    applied: float = 0.0
    computed: float = 0.0
    label: str = ""
    algorithm: str = "diloco"
    missed_groups: int = 0  # GroupMissed in the window's rounds, all learners
    wait_timeouts: int = 0  # window delta, all learners
    failures: int = 0  # PublishFailed / RoundFailed / PollFailed over the run
    busiest_down: float = 0.0  # the busiest learner's bytes down per round (counters)
    committed_rounds: int = 0  # 0 when none committed within max_seconds
    listed_keys: float = 0.0  # keys listings returned, per learner per round
    # Over the whole run, drain included: claims won at attempt >= 1, GroupMissed events,
    # Moshpit group records listing fewer than group_size members.
    failovers: int = 0
    missed_total: int = 0
    short_groups_total: int = 0
    undrained: int = 0  # training threads still running when the drain's deadline passed


@dataclass
class Closing:
    """One closing: its start (successful claim), its end (its record), its members, and
    its closer's comm-thread operations in between."""

    claim: float
    record: float
    members: int
    ops: list[Op]


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
        """``algorithm`` (default ``gm.DiLoCo(sync_every=args.sync_every, fragments=...)``);
        ``label`` names it; ``session_options``: more ``gm.Session`` keywords. ``drain``: at
        the end every learner trains on to the highest step count any had started, so that
        no round waits out ``round_timeout`` for a learner that stopped before it."""
        self.args, self.target, self.params = args, target, params
        self.n, self.p = learners, fragments
        self.algorithm = algorithm or gm.DiLoCo(sync_every=args.sync_every, fragments=fragments)
        self.label = label
        self.session_options = dict(session_options or {})
        self.drain = drain
        self._drain_to: int | None = None  # draining: the step count every learner trains to
        self._highest = 0  # the highest step count a learner started
        # Rounds of P fragments carry 1/P of the model each: measure twice as many when P > 1.
        self.rounds = args.rounds * min(fragments, 2)
        self.log: list[Op] = []
        self.listed: list[tuple[float, str, int]] = []
        self.registry = Registry()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.committed = fragments - 1  # newest committed round seen (initial: 0..P-1)
        self.sizes = (0, 0.0)  # the model's parameters, a fragment's bytes

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
                learner.steps.append((took, kind, time.monotonic()))
        except BaseException as exc:
            learner.error = exc

    def execute(self) -> Result:
        box, cleanup = self.target.fresh()
        try:
            return self._execute(box)
        finally:
            cleanup()

    def _execute(self, box: gm.Mailbox) -> Result:
        args = self.args
        name = f"{self.target.name} L={self.n} P={self.p} {self.label}".strip()
        base = build_model(self.params, self.p)
        total_params = sum(x.numel() for x in base.parameters())
        fragment_bytes = sum(x.numel() * x.element_size() for x in base.parameters()) / self.p
        self.sizes = (total_params, fragment_bytes)
        ref_step: list[float] = []
        if args.ref_steps:
            h.progress(f"{name}: reference: {args.ref_steps} bare steps of a 1M-param MLP")
            ref_step = reference_step(args.ref_steps)
        h.progress(f"{name}: raw put+get of {fragment_bytes / h.MIB:.1f} MiB x{args.reps}")
        blob = os.urandom(int(fragment_bytes))
        raw = [self.target.raw_put_get(blob) for _ in range(args.reps)]
        del blob

        h.progress(f"{name}: joining {self.n} learners ({total_params / 1e6:.1f}M params)")
        learners: list[Learner] = []
        for i in range(self.n):
            learner_id = f"learner-{i}"
            holder: list[Learner] = []

            def on_event(event: ev.Event, holder: list[Learner] = holder) -> None:
                if not holder:  # an event of the join, before the Learner exists
                    return
                holder[0].events.append((time.monotonic(), event))
                if isinstance(event, ev.Committed | ev.Applied):
                    with self.lock:
                        self.committed = max(self.committed, event.round)

            session = gm.Session(
                copy.deepcopy(base),
                algorithm=self.algorithm,
                mailbox=Recorder(box, learner_id, self.log, self.registry, self.listed),
                learner_id=learner_id,
                poll_interval=args.poll_interval,
                on_event=on_event,
                **self.session_options,
            )
            holder.append(Learner(learner_id, session))
            learners.append(holder[0])
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
                phase = "warm-up" if r0 is None else f"{newest - r0}/{self.rounds} measured"
                h.progress(f"{name}: round {newest} ({phase}, {now - started:.0f} s)")
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
            h.progress(f"{name}: draining to step {self._drain_to}")
        self.stop.set()
        drain_end = time.monotonic() + float(getattr(args, "drain_seconds", 60.0))
        for thread in threads:
            # Draining: one deadline for all (a stuck round would cost 30 s per thread).
            thread.join(timeout=max(0.0, drain_end - time.monotonic()) if self.drain else 30)
        undrained = sum(thread.is_alive() for thread in threads)
        if undrained:
            h.progress(f"{name}: {undrained} training threads still in step()")

        h.progress(f"{name}: closing ({r1 - r0} rounds measured in {t1 - t0:.1f} s)")
        errors = [f"{x.learner_id}: {x.error!r}" for x in learners if x.error]

        def close(learner: Learner) -> None:
            try:
                learner.session.close(timeout=30)
            except Exception as exc:
                errors.append(f"{learner.learner_id} close: {exc!r}")

        closers = [threading.Thread(target=close, args=(x,), daemon=True) for x in learners]
        for thread in closers:
            thread.start()
        for thread in closers:
            thread.join(timeout=60)

        result = self._analyse(learners, c0, c1, (t0, t1, r0, r1), raw, partial, errors)
        result.ref_step, result.cpu_seconds = ref_step, cpu1 - cpu0
        result.undrained = undrained
        return result

    # -- analysis --------------------------------------------------------------------------

    def _analyse(
        self,
        learners: list[Learner],
        c0: list[ev.Counters],
        c1: list[ev.Counters],
        span: tuple[float, float, int, int],
        raw: list[float],
        partial: bool,
        errors: list[str],
    ) -> Result:
        t0, t1, r0, r1 = span
        rounds = max(1, r1 - r0)
        per = rounds * self.n
        pairs = list(zip(c0, c1, strict=True))

        def kinds(name: str) -> Counter[str]:
            """A counter's window delta by key, summed over the learners."""
            out: Counter[str] = Counter()
            for a, b in pairs:
                for key, value in getattr(b, name).items():
                    out[key] += value - getattr(a, name).get(key, 0)
            return out

        def total(name: str) -> int:
            return int(sum(getattr(b, name) - getattr(a, name) for a, b in pairs))

        up, down, requests = kinds("bytes_up"), kinds("bytes_down"), kinds("requests")
        window = range(r0 + 1, r1 + 1)
        events = [(x, e) for x in learners for _, e in x.events]
        # Bytes by what they carried (recorder), ops that ended inside the window.
        purposes: Counter[str] = Counter()
        recorded = closes = 0
        for op in self.log:
            if t0 <= op.end <= t1:
                closes += op.op == "put" and op.key.startswith(("rounds/", p.GROUP_ROUNDS))
                label = purpose_of(op, self.registry)
                purposes[f"{label} [up]"] += op.up
                purposes[f"{label} [down]"] += op.down
                recorded += op.up + op.down
        purposes = Counter({k: v for k, v in purposes.items() if v})
        closings = [c for r, c in self._closings() if r in window]
        steps: dict[str, list[float]] = defaultdict(list)
        for x in learners:
            for seconds, kind, at in x.steps:
                if t0 <= at <= t1:
                    steps[kind].append(seconds)
        counted = float(sum(up.values()) + sum(down.values()))
        return Result(
            backend=self.target.name,
            learners=self.n,
            fragments=self.p,
            params=self.sizes[0],
            fragment_bytes=self.sizes[1],
            rounds=rounds,
            seconds=t1 - t0,
            up_down=counted / per,
            requests=sum(requests.values()) / per,
            lag=[
                e.lag_s
                for _, e in events
                if isinstance(e, ev.Applied) and e.contributed and e.round in window
            ],
            raw=h.median(raw),
            steps=dict(steps),
            purposes={k: v / per for k, v in purposes.items()},
            requests_by={k: v / per for k, v in requests.items()},
            phases=self._phases(learners, window),
            partial=partial,
            skipped=total("skipped_syncs"),
            errors=errors,
            counters_total=counted,
            recorder_total=float(recorded),
            closes=closes / rounds,
            closer_down=[self._down(c.ops) for c in closings],
            closer_snapshot_down=[self._down(c.ops, "snapshot") for c in closings],
            closer_momentum_down=[self._down(c.ops, "momentum") for c in closings],
            closer_seconds=[c.record - c.claim for c in closings],
            closer_snapshot_payloads=[self._payloads(c.ops) for c in closings],
            group_members=[c.members for c in closings] if self._moshpit else [],
            missed_groups=sum(
                isinstance(e, ev.GroupMissed) and e.round in window for _, e in events
            ),
            missed_total=sum(isinstance(e, ev.GroupMissed) for _, e in events),
            short_groups_total=self._short_groups(),
            failovers=self._failovers(),
            committed_rounds=max(0, r1 - r0),
            listed_keys=sum(k for at, _, k in self.listed if t0 <= at <= t1) / per,
            wait_timeouts=total("wait_timeouts"),
            busiest_down=max(
                (sum(b.bytes_down.values()) - sum(a.bytes_down.values()) for a, b in pairs),
                default=0,
            )
            / rounds,
            up=sum(up.values()) / per,
            down=sum(down.values()) / per,
            up_by_kind={k: v / per for k, v in up.items()},
            down_by_kind={k: v / per for k, v in down.items()},
            applied=total("applied") / per,
            computed=total("computed") / per,
            label=self.label,
            algorithm=self.algorithm.name,
            failures=sum(
                isinstance(e, ev.PublishFailed | ev.RoundFailed | ev.PollFailed) for _, e in events
            ),
        )

    @property
    def _moshpit(self) -> bool:
        return isinstance(self.algorithm, gm.Moshpit)

    def _comm_ops(self) -> dict[str, list[Op]]:
        comm: dict[str, list[Op]] = defaultdict(list)
        for op in self.log:
            if op.thread == "comm":
                comm[op.learner].append(op)
        return comm

    def _claims_and_records(self) -> tuple[dict[Any, dict[str, float]], dict[Any, float]]:
        """Successful claims' starts by closing and learner, and records' ends by closing: a
        closing is a round (DiLoCo) or a ``(round, group)`` (Moshpit)."""
        claims: dict[Any, dict[str, float]] = defaultdict(dict)
        records: dict[Any, float] = {}
        for op in self.log:
            if op.op != "put" or not op.ok:
                continue
            r = round_of(op.key)
            if self._moshpit:
                parts = op.key.split("/")
                if op.key.startswith(p.GROUP_CLAIMS) and len(parts) == 4 and parts[1].isdigit():
                    claims[(int(parts[1]), parts[2])][op.learner] = op.start
                elif op.key.startswith(p.GROUP_ROUNDS):
                    with contextlib.suppress(ProtocolError):
                        records[p.parse_group_round_key(op.key)] = op.end
            elif r is not None and op.key.startswith("claims/"):
                claims[r] = {"": op.start}  # the last successful claim of the round
            elif r is not None and op.key.startswith("rounds/"):
                records[r] = op.end
        return claims, records

    def _closings(self) -> list[tuple[int, Closing]]:
        """Every closing whose claim and record were both seen, by round: its closer's
        successful claim, its record, and the closer's comm-thread operations between."""
        claims, records = self._claims_and_records()
        comm = self._comm_ops()
        registry = self.registry
        found: list[tuple[int, Closing]] = []
        for key, end in sorted(records.items()):
            if self._moshpit:
                closer = registry.group_closer.get(key)
                start = claims.get(key, {}).get(closer or "")
            else:
                closer = registry.closer.get(key)
                start = claims.get(key, {}).get("")
            if closer is None or start is None:
                continue
            ops = [o for o in comm[closer] if start <= o.start <= o.end <= end]
            members = registry.group_members.get(key, 0) if self._moshpit else 0
            found.append((key[0] if self._moshpit else key, Closing(start, end, members, ops)))
        return found

    def _failovers(self) -> int:
        """Claims (of rounds or of groups) won at attempt >= 1, over the whole run."""
        won = 0
        for op in self.log:
            if op.op == "put" and op.ok:
                round_claim = op.key.startswith(p.CLAIMS) and round_of(op.key) is not None
                if round_claim or op.key.startswith(p.GROUP_CLAIMS):
                    with contextlib.suppress(ProtocolError):
                        won += p.parse_claim_attempt(op.key) >= 1
        return won

    def _short_groups(self) -> int:
        """Moshpit group records, over the whole run, listing fewer than M members."""
        if not isinstance(self.algorithm, gm.Moshpit):
            return 0
        m = self.algorithm.group_size
        return sum(1 for members in self.registry.group_members.values() if members < m)

    def _purpose(self, op: Op) -> str | None:
        return self.registry.purpose.get(self.registry.payload(op.key))

    def _down(self, ops: Sequence[Op], purpose: str | None = None) -> float:
        """Bytes ``ops`` downloaded (of blobs of ``purpose`` when given)."""
        return float(sum(o.down for o in ops if purpose is None or self._purpose(o) == purpose))

    def _payloads(self, ops: Sequence[Op]) -> int:
        """Distinct snapshot payloads ``ops`` downloaded (parts count as their payload)."""
        return len(
            {
                self.registry.payload(o.key)
                for o in ops
                if o.op == "get" and o.down and self._purpose(o) == "snapshot"
            }
        )

    def _phases(self, learners: list[Learner], window: range) -> dict[str, list[float]]:
        """Split each (round, contributor) latency into the phases it went through."""
        closing = {} if self._moshpit else dict(self._closings())
        published: dict[int, dict[str, float]] = defaultdict(dict)
        round_seen: dict[tuple[int, str], float] = {}
        params_get: dict[tuple[int, str], list[Op]] = defaultdict(list)  # index and parts
        round_by_params = self.registry.params_round
        for op in self.log:
            r = round_of(op.key)
            if op.op == "put" and op.key.startswith("snapshots/") and r is not None:
                published[r][op.learner] = op.end
            elif op.op == "get" and op.key.startswith("rounds/") and op.thread == "sync":
                if r is not None:
                    round_seen.setdefault((r, op.learner), op.start)
            elif op.op == "get" and op.thread == "sync":
                payload = self.registry.payload(op.key)
                if payload in round_by_params:
                    params_get[(round_by_params[payload], op.learner)].append(op)
        applied = {
            (e.round, x.learner_id): at
            for x in learners
            for at, e in x.events
            if isinstance(e, ev.Applied) and e.contributed
        }
        phases: dict[str, list[float]] = defaultdict(list)
        claims, records = self._claims_and_records()
        for r in window:
            mine = published.get(r)
            if not mine or r not in claims or r not in records:
                continue
            claim, record = claims[r][""], records[r]
            last = max(mine.values())
            ops = closing[r].ops if r in closing else []
            transfer = _covered([(o.start, o.end) for o in ops if o.key.startswith("blobs/")])
            phases["close detection"].append(claim - last)
            phases["closer: payload transfers"].append(transfer)
            phases["closer: other (records, combine, encode)"].append(record - claim - transfer)
            for learner, t in mine.items():
                if (r, learner) not in applied:
                    continue
                phases["wait for other learners"].append(last - t)
                if (r, learner) in round_seen:
                    phases["syncer: sees the record"].append(round_seen[(r, learner)] - record)
                gets = params_get.get((r, learner))
                if gets:
                    phases["syncer: params download"].append(
                        max(o.end for o in gets) - min(o.start for o in gets)
                    )
                phases["record -> applied"].append(applied[(r, learner)] - record)
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
