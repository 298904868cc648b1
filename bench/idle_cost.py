"""Benchmark 6 — idle cost: requests per learner per minute while nothing is due, the
dollar cost per node-hour at AWS S3 request prices, and how long a commit waits to be seen
after a learner idled.

Two learners (threads, each a ``gm.Session`` at the Session's defaults) join a run on the
filesystem mailbox (requests do not depend on the store) and sit idle for ``window`` seconds
(45; ``--quick`` 15); their requests come from ``session.counters()``. Then, ``rounds``
times, both step to a due fragment after idling a few seconds; a recording mailbox
(``_recorder.py``) times when the closer's ``rounds/`` record was written and when each
learner's syncer first read it, against ``poll_interval``.

Reference: AWS S3 Standard request prices (us-east-1): PUT, COPY, POST, LIST $0.005 per
1,000; GET $0.0004 per 1,000; DELETE free. Target: an idle learner under 30 requests per
minute, and no commit delayed by more than one poll interval.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import gradientmail as gm
from bench import _harness as h
from bench._recorder import Op, Recorder, Registry, round_of
from bench._workload import build_model
from gradientmail import events as ev

NAME = "idle"
PRICE_PER_1000 = {"put": 0.005, "list": 0.005, "get": 0.0004, "delete": 0.0}


def run(ctx: h.Context) -> h.Report:
    opts = ctx.options.get(NAME, {})
    window = opts.get("window") or ctx.pick(45.0, 15.0)
    rounds = opts.get("rounds") or ctx.pick(3, 2)
    gap = ctx.pick(6.0, 3.0)  # idle before each commit (the syncer idles once nothing is due)
    report = h.Report(
        NAME,
        "6. Idle cost: requests per idle learner, dollars per node-hour, commit delay",
        "AWS S3 Standard request prices (PUT/LIST $0.005, GET $0.0004 per 1,000; DELETE free) "
        "and the Session's poll_interval",
    )
    box = gm.FileMailbox(ctx.workdir / "idle-box")
    log: list[Op] = []
    registry = Registry()
    algorithm = gm.DiLoCo(sync_every=1000, fragments=1)
    applied: dict[tuple[str, int], float] = {}
    lock = threading.Lock()
    sessions: list[gm.Session] = []
    h.progress(f"idle: 2 learners join, then idle {window:.0f} s")
    for i in range(2):
        learner = f"idle-{i}"

        def on_event(event: ev.Event, learner: str = learner) -> None:
            if isinstance(event, ev.Applied):
                with lock:
                    applied[(learner, event.round)] = time.monotonic()

        sessions.append(
            gm.Session(
                build_model(1_000_000),
                algorithm=algorithm,
                mailbox=Recorder(box, learner, log, registry),
                learner_id=learner,
                on_event=on_event,
            )
        )
    try:
        time.sleep(2.0)  # past the join
        c0 = [s.counters() for s in sessions]
        t0 = time.monotonic()
        time.sleep(window)
        c1 = [s.counters() for s in sessions]
        elapsed = time.monotonic() - t0
        poll = sessions[0].poll_interval
        h.progress(f"idle: {rounds} commits after {gap:.0f} s of idling each")
        delays: list[float] = []
        waits: list[float] = []
        for _ in range(rounds):
            time.sleep(gap)
            before = [s.rounds for s in sessions]
            for s in sessions:
                with torch.no_grad():
                    next(s.model.parameters()).view(-1)[0] += 1e-3
                while (s.steps + 1) % algorithm.sync_every:
                    s.step()
                s.step()  # due: hands the fragment over
            deadline = time.monotonic() + 30
            while any(s.rounds == b for s, b in zip(sessions, before, strict=True)):
                if time.monotonic() > deadline:
                    raise TimeoutError("idle: a commit did not arrive within 30 s")
                time.sleep(0.005)
                for s in sessions:
                    s.step()
            r = sessions[0].rounds[0]
            mine = [op for op in log if op.key.startswith("rounds/") and round_of(op.key) == r]
            written = [op.end for op in mine if op.op == "put" and op.ok]
            seen: dict[str, float] = {}
            for op in mine:
                if op.op == "get" and op.thread == "sync":
                    seen.setdefault(op.learner, op.start)
            if written:
                delays += [max(at - written[0], 0.0) for at in seen.values()]
                waits += [at - written[0] for (_, rr), at in applied.items() if rr == r]
            # The closer stages its own commit without reading the record: no delay to see.
    finally:
        for s in sessions:
            s.close(timeout=30)

    per_minute: dict[str, float] = {}
    for a, b in zip(c0, c1, strict=True):
        for key, value in b.requests.items():
            per_minute[key] = per_minute.get(key, 0.0) + (value - a.requests.get(key, 0))
    per_minute = {k: v / len(sessions) / elapsed * 60 for k, v in per_minute.items() if v}
    total = sum(per_minute.values())
    dollars = sum(
        rate * 60 * PRICE_PER_1000[key.split(":")[0]] / 1000 for key, rate in per_minute.items()
    )
    table = report.table(
        f"An idle learner, {elapsed:.0f} s window, 2 learners at the Session defaults "
        f"(poll_interval {poll} s, idle_poll_interval {sessions[0].idle_poll_interval} s, "
        "lease_timeout 15 s)",
        ["request", "per learner per minute", "S3 price / 1,000", "$ per node-hour"],
        note=(
            "Per node-month (730 h): "
            f"${dollars * 730:.3f}. The window sees the batched delete of old beats "
            "(one per eight beats, i.e. every 40 s) about once per 40 s; a short window may "
            "miss it or see it once."
        ),
    )
    for key in sorted(per_minute):
        price = PRICE_PER_1000[key.split(":")[0]]
        dollars_per_hour = per_minute[key] * 60 * price / 1000
        table.add(key, f"{per_minute[key]:.1f}", f"${price:.4f}", f"${dollars_per_hour:.5f}")
    table.add("total", f"{total:.1f}", "", f"${dollars:.5f}")
    delay = h.Stats.of(delays)
    wait = h.Stats.of(waits)
    table = report.table(
        f"A commit after {gap:.0f} s of idling ({rounds} commits, both learners contributing)",
        ["measure", "median (min–max)", "vs poll_interval"],
        note=(
            "Record written -> seen: from the end of the closer's put of the `rounds/` record "
            "to the start of a syncer's get of it (the learners that read it; the closer "
            "stages its own result without reading). -> applied: to the training thread's "
            "Applied event (every learner, the closer included; 5 ms steps)."
        ),
    )
    table.add("record written -> seen by a syncer", h.secs_range(delay), h.ratio(delay.max, poll))
    table.add("record written -> applied", h.secs_range(wait), h.ratio(wait.max, poll))
    report.target(
        "requests per idle learner per minute",
        f"{total:.1f} (${dollars:.5f} per node-hour at S3 prices)",
        "< 30 per minute",
        total < 30,
    )
    report.target(
        "delay before a waiting learner sees its commit, after idling",
        f"at most {h.secs(delay.max)} over {delay.n} (commit, learner) pairs",
        f"<= one poll_interval ({poll} s)",
        None if delay.n == 0 else delay.max <= poll,
    )
    data: dict[str, Any] = {
        "window_s": elapsed,
        "requests_per_minute": per_minute,
        "total_per_minute": total,
        "dollars_per_node_hour": dollars,
        "seen_delay_s": delays,
        "applied_delay_s": waits,
        "poll_interval_s": poll,
    }
    report.data = data
    return report
