"""Benchmark 9 — utilization: the fraction of wall time ``step()`` holds the training thread
at a realistic step time, under each sync policy, and how many sync points contribute.

4 learner processes (each its own ``gm.Session``, one torch thread) train a 10M-parameter
model (``_workload.build_model``, one fragment) with a 50 ms step and
``DiLoCo(sync_every=50)``, ``quorum_size=4``, on the filesystem mailbox and on SeaweedFS,
once per policy: ``overlap=0`` (the default: exact DiLoCo), ``overlap=5``, ``overlap=10``
and ``free_running=True`` (a sync point whose previous round is in flight is skipped).

The step is simulated so that 4 learners fit on 2 cores: a deterministic in-place update of
a rotating window of 65,536 elements of every parameter tensor (the snapshots differ, the
payloads are real), then a sleep for the rest of the 50 ms, leaving the CPU to the Session's
threads as a GPU step would. Measured per learner over the training loop (after all met at
a ``gm.Barrier``; ``close()`` timed apart): wall time, time inside ``step()``,
``Counters.waited_s`` and ``waits``, sync points reached vs contributed, commit lag, each
contribution's round trip from its sync point to its commit applied, the calls that copy
out or apply without waiting, CPU time. Reference: the bare loop, the same steps without a
Session in the same processes, all at once, before they join. The loop runs ``periods``
sync periods plus half a period, so the last commit falls inside it under every policy.

Targets (reported, never asserted): < 5% of the wall time in ``step()`` under the default
policy (INTELLECT-1 and OpenDiLoCo report 90–96% compute utilization); 100% of sync points
contributing under the waiting policies.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import gradientmail as gm
from bench import _harness as h
from bench import _procs
from bench._workload import BATCH, build_model
from gradientmail import events as ev

NAME = "utilization"

# Session keyword arguments per policy, in the order the tables list them.
POLICIES: dict[str, dict[str, Any]] = {
    "overlap=0": {},
    "overlap=5": {"overlap": 5},
    "overlap=10": {"overlap": 10},
    "free_running": {"free_running": True},
}
DEFAULT_POLICY = "overlap=0"
BACKENDS = ("filesystem", "seaweedfs")


@dataclass(frozen=True)
class Config:
    params: int = 10_000_000
    step_ms: float = 50.0
    sync_every: int = 50
    learners: int = 4
    periods: int = 6  # sync points reached inside the measured loop
    tail: int | None = None  # steps after the last sync point (default: half a period)
    window: int = 65_536  # elements of each parameter tensor the simulated step updates
    backends: tuple[str, ...] = BACKENDS
    policies: tuple[str, ...] = tuple(POLICIES)
    poll_interval: float = 0.5  # Session's default
    timeout: float = 180.0  # a barrier, a join, a close

    @property
    def tail_steps(self) -> int:
        return self.sync_every // 2 if self.tail is None else self.tail

    @property
    def steps(self) -> int:
        return self.periods * self.sync_every + self.tail_steps


def config_for(ctx: h.Context) -> Config:
    """The preset's sizes, then any ``ctx.options["utilization"]`` overrides (tests)."""
    config = Config(periods=ctx.pick(6, 3, 20))
    return h.overridden(
        config, ctx.options.get(NAME), {"policies": list(POLICIES), "backends": list(BACKENDS)}
    )


# -- the learner processes -------------------------------------------------------------------


class _Work:
    """The simulated training step: a real in-place update of a window of every parameter
    tensor (deterministic, distinct per learner), then a sleep to the step time."""

    def __init__(self, model: torch.nn.Module, index: int, config: Config) -> None:
        self.flats = [p.detach().view(-1) for p in model.parameters()]
        largest = max(f.numel() for f in self.flats)
        generator = torch.Generator().manual_seed(1000 + index)
        self.noise = torch.randn(min(config.window, largest), generator=generator) * 1e-4
        self.step_s = config.step_ms / 1000

    def step(self, number: int) -> float:
        """One training step; returns the seconds the update itself took."""
        start = time.perf_counter()
        with torch.no_grad():
            for flat in self.flats:
                width = min(self.noise.numel(), flat.numel())
                at = (number * width) % (flat.numel() - width + 1)
                flat[at : at + width].add_(self.noise[:width])
        cost = time.perf_counter() - start
        if cost < self.step_s:
            time.sleep(self.step_s - cost)
        return cost


def _learner(
    index: int, config: Config, tasks: list[tuple[str, gm.Mailbox]], barrier: Any, queue: Any
) -> None:
    h.guarded(index, barrier, queue, lambda: _learn(index, config, tasks, barrier, queue))


def _learn(
    index: int, config: Config, tasks: list[tuple[str, gm.Mailbox]], barrier: Any, queue: Any
) -> None:
    torch.set_num_threads(1)  # four processes on two cores
    model = build_model(config.params)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    work = _Work(model, index, config)

    # The reference: the same steps without a Session, all learners at once.
    barrier.wait(timeout=config.timeout)
    cpu_from, start = time.process_time(), time.perf_counter()
    updates = [work.step(number) for number in range(config.steps)]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_from
    queue.put(
        {
            "index": index,
            "phase": "bare",
            "wall_s": wall,
            "cpu_s": cpu,
            "update_s": h.median(updates),
            "update_max_s": max(updates),
        }
    )
    for policy, mailbox in tasks:
        model.load_state_dict(initial)  # in place: the work's views stay valid
        barrier.wait(timeout=config.timeout)  # the previous policy closed everywhere
        queue.put(_policy(index, policy, mailbox, model, work, config, queue))


def _policy(
    index: int,
    policy: str,
    mailbox: gm.Mailbox,
    model: torch.nn.Module,
    work: _Work,
    config: Config,
    queue: Any,
) -> dict[str, Any]:
    events = _procs.Events()
    learner_id = f"learner-{index}"
    started = time.perf_counter()
    session = gm.Session(
        model,
        algorithm=gm.DiLoCo(sync_every=config.sync_every),
        mailbox=mailbox,
        learner_id=learner_id,
        quorum_size=config.learners,
        poll_interval=config.poll_interval,
        on_event=events,
        **POLICIES[policy],
    )
    join_s = time.perf_counter() - started
    with session:
        # Rounds include everybody: nobody trains before all have joined.
        gm.Barrier(mailbox=mailbox, learner_id=learner_id, poll_interval=0.05).wait(
            "utilization-start", parties=config.learners, timeout=config.timeout
        )
        in_step = longest = 0.0
        updates = []
        inner: list[int] = []  # local steps each contribution covered
        calls: list[tuple[int, float, bool]] = []  # (step, seconds, applied a commit)
        handed: list[tuple[int, float]] = []  # (round, monotonic at its sync point's call)
        contributed_at: set[int] = set()  # the steps of the sync points that contributed
        open_rounds: deque[tuple[int, float]] = deque()  # handed over, not yet applied
        round_trip: list[float] = []  # sync point -> its commit applied, as training sees it
        before = session.counters()
        loop_from, cpu_from, start = time.monotonic(), time.process_time(), time.perf_counter()
        for number in range(config.steps):
            updates.append(work.step(number))
            rounds = session.rounds[0]
            at = time.monotonic()
            t = time.perf_counter()
            session.step(samples=BATCH)
            took = time.perf_counter() - t
            in_step += took
            longest = max(longest, took)
            now = session.rounds[0]
            due = session.steps % config.sync_every == 0  # a sync point (one fragment)
            if due or took > 0.001 or now != rounds:
                calls.append((session.steps, took, now != rounds))
            if due:
                c = session.counters()
                if c.skipped_syncs == before.skipped_syncs:  # contributed
                    inner.append(c.last_inner_steps)
                    # The round handed over: applied within this call when step() waited
                    # for it (overlap=0, unless the wait gave up), else the next one.
                    exact = session.overlap == 0 and not session.free_running
                    timed_out = c.wait_timeouts != before.wait_timeouts
                    r = now if exact and not timed_out else now + 1
                    handed.append((r, at))
                    contributed_at.add(session.steps)
                    open_rounds.append((r, at))
                before = c
                if index == 0:
                    queue.put({"progress": f"{policy}: step {session.steps}/{config.steps}"})
            while open_rounds and open_rounds[0][0] <= now:
                round_trip.append(time.monotonic() - open_rounds.popleft()[1])
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_from
        loop_to = time.monotonic()
        loop = session.counters()
        rounds_in_loop = session.rounds[0]
        t = time.perf_counter()
        session.close(timeout=config.timeout)
        close_s = time.perf_counter() - t
    final = session.counters()
    waited = events.of(ev.SyncWaited)
    wait_steps = {e.step for _, e in waited}
    published = {e.round: at for at, e in events.of(ev.Published)}
    return {
        "index": index,
        "phase": policy,
        "join_s": join_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "in_step_s": in_step,
        "longest_step_s": longest,
        "update_s": h.median(updates),
        "waited_s": loop.waited_s,
        "waits": loop.waits,
        "wait_timeouts": loop.wait_timeouts,
        "wait_s": [e.seconds for at, e in waited if loop_from <= at <= loop_to],
        "sync_points": loop.sync_points,
        "skipped_syncs": loop.skipped_syncs,
        "contributed": loop.sync_points - loop.skipped_syncs,
        "inner_steps": inner,
        "lag_s": [e.lag_s for _, e in events.of(ev.Applied) if e.contributed],
        "round_trip_s": round_trip,
        "publish_s": [published[r] - at for r, at in handed if r in published],
        # step() calls that did not wait: copying the due fragment out, applying a commit.
        "copy_out_s": [
            took
            for step, took, applied in calls
            if step in contributed_at and step not in wait_steps and not applied
        ],
        "apply_s": [took for step, took, applied in calls if applied and step not in wait_steps],
        "rounds_in_loop": rounds_in_loop,
        "rounds_final": session.rounds[0],
        "close_s": close_s,
        "published_final": final.published,
        "sync_points_final": final.sync_points,
        "skipped_final": final.skipped_syncs,
        "failures": events.failures()[:20],
    }


# -- the parent side -------------------------------------------------------------------------


def run_backend(ctx: h.Context, config: Config, backend: str) -> dict[str, Any]:
    """All policies on one backend, in one set of learner processes; per learner results."""
    slugs = [f"utilization-{x.replace('=', '').replace('_', '-')}" for x in config.policies]
    with _procs.stores(backend, ctx.workdir, slugs) as boxes:
        tasks = list(zip(config.policies, boxes, strict=True))
        h.progress(
            f"{backend}: {config.learners} learner processes, "
            f"{config.params / 1e6:g}M params, {config.steps} steps of {config.step_ms:g} ms, "
            f"policies {', '.join(config.policies)}"
        )
        procs, queue, _ = _procs.spawn(_learner, config.learners, (config, tasks), "utilization")
        phases = ["bare", *config.policies]
        loop_s = config.steps * config.step_ms / 1000
        seen: set[tuple[str, int]] = set()

        def heard(item: dict[str, Any]) -> None:
            seen.add((item["phase"], item["index"]))
            done = [x for x in phases if all((x, i) in seen for i in range(config.learners))]
            if item["index"] == 0 or len(done) == len(phases):
                h.progress(f"{backend}: {item['phase']}: learner-{item['index']} done")

        items, errors = _procs.gather(
            procs,
            queue,
            config.learners * len(phases),
            backend,
            limit_s=120 + len(phases) * (4 * loop_s + config.timeout),
            on_result=heard,
            join_s=30,
        )
    results = {(item["phase"], item["index"]): item for item in items}
    missing = [x for x in phases if any((x, i) not in results for i in range(config.learners))]
    if errors or missing:
        raise RuntimeError(f"{backend}: {'; '.join(errors) or 'no result'} (missing: {missing})")
    return {phase: [results[(phase, i)] for i in range(config.learners)] for phase in phases}


# -- the report ------------------------------------------------------------------------------


def summarize(config: Config, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per backend and policy: the statistics over learners the tables show."""
    out: dict[str, Any] = {}
    for backend, phases in runs.items():
        bare = phases["bare"]
        bare_wall = [x["wall_s"] for x in bare]
        row: dict[str, Any] = {
            "bare": {
                "wall_s": h.Stats.of(bare_wall).__dict__,
                "update_s": h.Stats.of(x["update_s"] for x in bare).__dict__,
                "update_max_s": max(x["update_max_s"] for x in bare),
                "cpu_cores": h.Stats.of(x["cpu_s"] / x["wall_s"] for x in bare).__dict__,
            }
        }
        for policy in config.policies:
            learners = phases[policy]

            def each(value: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
                return h.Stats.of(value(x) for x in learners).__dict__  # noqa: B023

            def pooled(key: str) -> dict[str, Any]:
                return h.Stats.of(s for x in learners for s in x[key]).__dict__  # noqa: B023

            reached = sum(x["sync_points"] for x in learners)
            contributed = sum(x["contributed"] for x in learners)
            row[policy] = {
                "wall_s": each(lambda x: x["wall_s"]),
                "wall_over_bare": h.Stats.of(
                    x["wall_s"] / b for x, b in zip(learners, bare_wall, strict=True)
                ).__dict__,
                "in_step_s": each(lambda x: x["in_step_s"]),
                "step_fraction": each(lambda x: x["in_step_s"] / x["wall_s"]),
                "waited_fraction": each(lambda x: x["waited_s"] / x["wall_s"]),
                "step_outside_waits_fraction": each(
                    lambda x: (x["in_step_s"] - x["waited_s"]) / x["wall_s"]
                ),
                "waits": each(lambda x: x["waits"]),
                "wait_timeouts": sum(x["wait_timeouts"] for x in learners),
                "single_wait_s": pooled("wait_s"),
                "longest_step_s": max(x["longest_step_s"] for x in learners),
                "sync_points": reached,
                "contributed": contributed,
                "contributing": contributed / reached if reached else math.nan,
                "skipped": sum(x["skipped_syncs"] for x in learners),
                # Local steps per contribution over the loop: a skipped sync point's steps
                # go into a later contribution (the last ones into close()'s).
                "effective_inner_steps": (
                    config.sync_every * reached / contributed if contributed else math.nan
                ),
                **{k: pooled(k) for k in ("inner_steps", "lag_s", "round_trip_s")},
                **{k: pooled(k) for k in ("publish_s", "copy_out_s", "apply_s")},
                "cpu_cores": each(lambda x: x["cpu_s"] / x["wall_s"]),
                "rounds_in_loop": each(lambda x: x["rounds_in_loop"]),
                "rounds_final": max(x["rounds_final"] for x in learners),
                "close_s": each(lambda x: x["close_s"]),
                "join_s": each(lambda x: x["join_s"]),
                "failures": sum(len(x["failures"]) for x in learners),
            }
        out[backend] = row
    return out


def _st(r: dict[str, Any], key: str) -> h.Stats:
    return h.Stats(**r[key])


def _pct(st: h.Stats) -> str:
    return h.spread(st, lambda v: f"{100 * v:.1f}", "%")


def _inner(r: dict[str, Any]) -> str:
    inner = _st(r, "inner_steps")
    each = f"(each {inner.min:.0f}–{inner.max:.0f})"
    return "-" if inner.n == 0 else f"{r['effective_inner_steps']:.1f} {each}"


Column = tuple[str, Callable[[dict[str, Any]], object]]
# Per policy row after (mailbox, policy): (header, cell from the policy's summary).
WAITING: list[Column] = [
    ("loop wall time", lambda r: h.secs_range(_st(r, "wall_s"))),
    ("wall / bare loop", lambda r: h.spread(_st(r, "wall_over_bare"), lambda v: f"{v:.2f}", "x")),
    ("step() wait fraction", lambda r: _pct(_st(r, "step_fraction"))),
    ("of which waiting (waited_s)", lambda r: _pct(_st(r, "waited_fraction"))),
    ("step() outside waits", lambda r: _pct(_st(r, "step_outside_waits_fraction"))),
    ("waits per learner", lambda r: h.spread(_st(r, "waits"))),
    ("single wait", lambda r: h.secs_range(_st(r, "single_wait_s"))),
    ("longest step()", lambda r: h.secs(r["longest_step_s"])),
]
SYNCS: list[Column] = [
    ("sync points reached", lambda r: r["sync_points"]),
    ("contributed", lambda r: r["contributed"]),
    ("contributing", lambda r: h.pct(r["contributed"], r["sync_points"])),
    ("skipped", lambda r: r["skipped"]),
    ("wait timeouts", lambda r: r["wait_timeouts"]),
    ("inner steps per contribution", _inner),
    ("commit lag", lambda r: h.secs_range(_st(r, "lag_s"))),
    ("rounds committed (loop end / after close)",
     lambda r: f"{_st(r, 'rounds_in_loop').median:.0f} / {r['rounds_final']}"),
    ("close()", lambda r: h.secs_range(_st(r, "close_s"))),
]  # fmt: skip


def _trips(step_s: float) -> list[Column]:
    def in_steps(r: dict[str, Any]) -> str:
        trip = _st(r, "round_trip_s")
        return "-" if trip.n == 0 else f"{trip.median / step_s:.0f}"

    return [
        ("sync point -> commit applied", lambda r: h.secs_range(_st(r, "round_trip_s"))),
        ("of which publishing", lambda r: h.secs_range(_st(r, "publish_s"))),
        ("in steps", in_steps),
        ("copy-out call", lambda r: h.secs_range(_st(r, "copy_out_s"))),
        ("apply call", lambda r: h.secs_range(_st(r, "apply_s"))),
        ("CPU per learner (all threads)",
         lambda r: h.spread(_st(r, "cpu_cores"), lambda v: f"{v:.2f}", " cores")),
    ]  # fmt: skip


def run(ctx: h.Context) -> h.Report:
    config = config_for(ctx)
    report = h.Report(
        NAME,
        "9. Utilization: the fraction of wall time step() holds the training thread",
        "the bare loop: the same simulated steps without a Session, in the same learner "
        "processes, all at once, before they join",
    )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    errors: dict[str, str] = {}
    for backend in config.backends:
        try:
            runs[backend] = run_backend(ctx, config, backend)
        except Exception as exc:
            errors[backend] = f"{type(exc).__name__}: {exc}"
            report.notes.append(f"{backend}: not measured: {errors[backend]}")
    if not runs:
        raise RuntimeError("; ".join(f"{k}: {v}" for k, v in errors.items()))
    summary = summarize(config, runs)

    what = (
        f"{config.learners} learner processes, {config.params / 1e6:g}M params, "
        f"{config.step_ms:g} ms step, DiLoCo(sync_every={config.sync_every}), "
        f"quorum_size={config.learners}, {config.steps} steps ({config.periods} sync points "
        f"+ {config.tail_steps} steps)"
    )
    notes = [
        "step() wait fraction = time inside step() (perf_counter around each call) / "
        "the loop's wall time; waited_s is Counters.waited_s (the training thread held "
        "for a commit); outside waits: copying the due fragment out and applying "
        "commits. The bare loop runs the same steps without a Session, in the same "
        "processes, all learners at once, before they join. "
        f"The {config.step_ms:g} ms step is simulated: an in-place update of "
        f"{config.window:,} elements of every parameter tensor (a rotating window, distinct "
        "per learner), then a sleep for the rest of the step, so 4 learners fit on 2 cores "
        "and the CPU is left to the Session's threads, as a GPU step would leave it.",
        "Sync points and contributions: totals over learners, inside the loop (close() "
        "then contributes the tail). Inner steps per contribution: sync_every x sync "
        "points reached / contributed (a skipped sync point's steps go into a later "
        "contribution), and the min–max of the local steps each contribution in the "
        f"loop covered (Counters.last_inner_steps); sync_every is {config.sync_every}. "
        "Commit lag: Applied.lag_s, publish to applied, median (min–max) over (learner, "
        "round). Rounds: median over learners at the end of the loop / the newest after "
        "close().",
        "Sync point -> commit applied: from the start of the step() call that handed the "
        "fragment over to the end of the call that applied its commit, as the training "
        "thread sees it (median, min–max over contributions in the loop); publishing: "
        "to the Published event (hash + upload of the snapshot and its record); in "
        f"steps: the median round trip over the {config.step_ms:g} ms step, the overlap "
        "that would hide it. Copy-out and apply calls: step() calls at a sync point or "
        "applying a commit without waiting. CPU: the process's CPU time over the loop "
        "(training thread and the Session's threads) per second of wall time; the bare "
        "loop's beside the mailbox name.",
    ]
    titles = [
        f"Training-thread time in step(): {what} (median over learners, min–max)",
        f"Sync points and commits: {what}",
        "Where the waiting comes from: the round trip of a contribution, and step() calls "
        "that did not wait",
    ]
    specs = [WAITING, SYNCS, _trips(config.step_ms / 1000)]
    for i, (title, columns, note) in enumerate(zip(titles, specs, notes, strict=True)):
        table = report.table(title, ["mailbox", "policy", *(c for c, _ in columns)], note)
        for backend, row in summary.items():
            mailbox = backend
            if i == 0:  # the reference's row
                bare = h.secs_range(_st(row["bare"], "wall_s"))
                table.add(backend, "bare loop (no Session)", bare, "1.00x", *["-"] * 6)
            if i == 2:
                mailbox += f" (bare loop {_st(row['bare'], 'cpu_cores').median:.2f} cores)"
            for policy in config.policies:
                label = f"{policy} (default)" if policy == DEFAULT_POLICY else policy
                table.add(mailbox, label, *(cell(row[policy]) for _, cell in columns))

    for backend in config.backends:
        name = f"step() wait fraction, {DEFAULT_POLICY} (default), {backend}"
        if backend not in summary:
            report.target(name, "not measured", "< 5%", None, errors.get(backend, ""))
            continue
        row = summary[backend]
        if DEFAULT_POLICY in row:
            st = _st(row[DEFAULT_POLICY], "step_fraction")
            waited = _pct(_st(row[DEFAULT_POLICY], "waited_fraction"))
            report.target(
                name,
                f"{_pct(st)} median over learners (min–max); waiting for commits {waited}",
                "< 5% (INTELLECT-1, OpenDiLoCo: 90–96% compute utilization)",
                st.median < 0.05,
            )
        waiting = [x for x in config.policies if not POLICIES[x].get("free_running")]
        if waiting:
            reached = sum(row[x]["sync_points"] for x in waiting)
            contributed = sum(row[x]["contributed"] for x in waiting)
            report.target(
                f"sync points contributing, {', '.join(waiting)}, {backend}",
                f"{contributed} of {reached} ({h.pct(contributed, reached)})",
                "100%",
                reached > 0 and contributed == reached,
            )
        if "free_running" in row:
            r = row["free_running"]
            report.notes.append(
                f"{backend}, free_running: {r['skipped']} of {r['sync_points']} sync points "
                f"skipped; effective inner steps per contribution {r['effective_inner_steps']:.1f} "
                f"(sync_every {config.sync_every})"
            )
        update = _st(row["bare"], "update_s")
        report.notes.append(
            f"{backend}: the simulated step's parameter update took {h.secs(update.median)} "
            f"median ({h.secs(row['bare']['update_max_s'])} at most) of its "
            f"{config.step_ms:g} ms in the bare loop; the rest is a sleep"
        )
        failures = {x: row[x]["failures"] for x in config.policies if row[x]["failures"]}
        if failures:
            report.notes.append(
                f"{backend}: failure events (PollFailed, PublishFailed, RoundFailed) per "
                f"policy: {failures}"
            )

    report.data = {
        "config": dataclasses.asdict(config) | {"steps": config.steps},
        "summary": summary,
        "learners": runs,
        "errors": errors,
    }
    return report


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main([NAME, *sys.argv[1:]]))
