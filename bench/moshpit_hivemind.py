"""Moshpit averaging, hivemind's against GradientMail's, at N processes of this machine.

Both systems average one float32 tensor of ``--params`` elements (1M; ``--quick`` 100k)
held by N processes in groups of M = 2 on a full grid of d = log2 N dimensions (N = M ** d),
for K = d + 2 measured rounds (``--quick``: d) after one untimed warm-up round. N is 4, 8,
16 and 32 for both, and 64 for GradientMail alone (``--gm-only-peers``; hivemind would not
fit, see below); ``--quick`` is N = 4. Before the measured rounds process ``i`` sets its
tensor to ``float(i)``; after each round it reports the squared distance of its tensor to
the initial global mean ``(N - 1) / 2``. Measured per system and N:

- **s per round**: how long each ``step()`` call blocked its caller, median (min–max) over
  the K rounds and the N processes (a failed step counts with the time it took);
- **failed**: hivemind, steps that returned None or raised (no group found in time);
  GradientMail, contributions that came after their group had closed (``missed_groups``),
  wait time-outs and step() exceptions; out of N·K;
- **spread after d / after K**: Σ_i ||x_i − x̄||² over the processes, divided by its value
  before the first measured round. On a full grid with every group full, d rounds average
  every process with every other: the spread is exactly 0 (the values are small integers,
  their pairwise means exact in float32);
- **GradientMail/hivemind**: the ratio of the two medians at that N.

**hivemind** (1.1.12, in its own venv: ``bench/hivemind_setup.py``): one driver process
(``bench/_hivemind_moshpit_worker.py``, run by the hivemind venv's python) forks N peers;
each starts its own ``hivemind.DHT`` (peer 0 the bootstrap, the others given its
addresses) and a ``DecentralizedAverager(target_group_size=M, min_group_size=2,
initial_group_bits=...)``: the grid of hivemind's own ``test_allreduce_grid``, peer i's bits
its grid coordinates along dimensions 1 .. d-1; hivemind shifts each round's chunk index
into the key, so round t averages along dimension (t-1) mod d. A peer is four processes
(the peer, its DHT, its averager, a p2pd daemon). ``min_matchmaking_time`` (with
``request_timeout`` half of it) is 0.5 s at N <= 4, 2 s at N = 8, 16 and 5 s (hivemind's
default) above; ``step(timeout=max(20 s, 6 matchmaking times))``. Chosen on this machine
(2 cores, shared with other work, so every figure is noisy): N=4: 0.5 s gave ~0.3 s rounds,
2 s ~0.35 s; N=8: 0.5 / 1 / 2 s gave 1.0 / 1.2 / 0.8 s; N=16: 0.5 s found no group at all
(every step timed out: the peers' matchmaking requests time out on 2 cores), 1 s gave
6.4 s with failed steps, 2 s 2.3 s, 3 s 5.7 s; N=32: 2 s failed 154 of 160 steps, 5 s
none, at ~13 s per round. 32 peers held ~9 GiB: 64 would not fit beside the other work on
this machine's 23 GiB, so hivemind stops at N = 32 here. ``--min-matchmaking-time`` and
``--hivemind-timeout`` override.

**GradientMail**: N processes forked from this one (``GMConfig(processes=False)``: threads
of it, the test's cheaper fleet), each a ``gm.Session`` on a module holding one Parameter
of ``--params`` float32, ``algorithm=gm.Moshpit(sync_every=1, group_size=M,
grid_dims=d)``, ``mailbox=gm.FileMailbox(dir)`` (a directory on the local disk, fsync on:
its default), ``round_timeout`` 10 s, ``poll_interval`` 0.05 s (the default 0.5 s is tuned
for request costs, not latency). Every ``step()`` is a sync point (``sync_every=1``) and,
with ``overlap=0``, waits for its group's commit. A process's slot (its grid cell) is the
smallest free one when it joins.

Both sides run one torch thread per process. When hivemind cannot be run (no venv, its
peers fail) the table says why and GradientMail is still measured.

    .venv/bin/python -m bench.moshpit_hivemind [--quick] [--peers 4,8,16,32]
        [--gm-only-peers 64] [--params 1M] [--rounds K]
        [--out bench/results/moshpit-hivemind.md] [--no-hivemind] [--hivemind-python PATH]
        [--no-install]

hivemind's venv is created on first use, as the suite does (``--no-install``: reported
missing instead).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue as stdqueue
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail as gm
from bench import _harness as h
from bench.hivemind_setup import Unavailable, locate
from gradientmail import events as ev

NAME = "moshpit-hivemind"
NOT_RUN = (
    "not run at this N (--gm-only-peers): a hivemind peer is four processes (the peer, its "
    "DHT, its averager, a p2pd daemon); 32 of them held ~9 GiB of this machine's 23 GiB "
    "and needed min_matchmaking_time 5 s (module docstring)"
)
WORKER = Path(__file__).resolve().parent / "_hivemind_moshpit_worker.py"
HEADER = [
    "system", "N", "M", "d", "rounds K", "s per round (min–max)", "failed",
    "spread after d", "spread after K", "GradientMail/hivemind", "settings",
]  # fmt: skip


def dims_of(peers: int, group_size: int) -> int:
    """d with ``group_size ** d == peers``; ValueError when ``peers`` is no such power."""
    if group_size < 2:
        raise ValueError(f"M={group_size}: a group has at least 2 members")
    dims = 1
    while group_size**dims < peers:
        dims += 1
    if group_size**dims != peers:
        raise ValueError(f"N={peers} is not a power of M={group_size} (a full grid)")
    return dims


def matchmaking_time(peers: int) -> float:
    """hivemind's ``min_matchmaking_time`` used at ``peers`` (module docstring)."""
    if peers <= 4:
        return 0.5
    return 2.0 if peers <= 16 else 5.0


def step_timeout(min_matchmaking_time: float) -> float:
    """hivemind's ``step(timeout=...)``: 20 s, or 6 matchmaking times when longer."""
    return max(20.0, 6 * min_matchmaking_time)


@dataclass(frozen=True)
class Result:
    """One system at one N. ``error``: why it was not measured (the rest is then empty)."""

    system: str
    peers: int
    group_size: int
    dims: int
    rounds: int
    settings: str
    step_s: tuple[float, ...] = ()
    failed: int = 0
    calls: int = 0
    spread_d: float = math.nan
    spread_k: float = math.nan
    seconds: float = math.nan
    error: str = ""
    notes: tuple[str, ...] = ()

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else math.nan


def _spreads(
    sq0: Sequence[float], rounds: Sequence[Sequence[float]], dims: int
) -> tuple[float, float]:
    """(spread after d rounds, after all of them): Σ sq after that round / Σ sq0."""
    initial = sum(sq0)
    if not rounds or initial <= 0:
        return math.nan, math.nan
    after = [sum(per_peer[r] for per_peer in rounds) / initial for r in range(len(rounds[0]))]
    return (after[dims - 1] if len(after) >= dims else math.nan), after[-1]


# -- GradientMail ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GMConfig:
    peers: int
    group_size: int
    params: int
    rounds: int
    warmup: int = 1
    poll_interval: float = 0.05
    round_timeout: float = 10.0
    timeout: float = 120.0  # for the barriers, and per process for the whole run after that
    processes: bool = True  # False: threads of this process (the test's cheaper fleet)

    @property
    def dims(self) -> int:
        return dims_of(self.peers, self.group_size)


class _Vector(torch.nn.Module):
    """A model that is one float32 Parameter."""

    def __init__(self, params: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(params))


def _sq(tensor: torch.Tensor, mean: float) -> float:
    return float(((tensor.detach().double() - mean) ** 2).sum())


def _gm_learner(index: int, root: str, config: GMConfig, barrier: Any, queue: Any) -> None:
    h.guarded(index, barrier, queue, partial(_gm_learn, index, root, config, barrier))


def _gm_learn(index: int, root: str, config: GMConfig, barrier: Any) -> dict[str, Any]:
    torch.set_num_threads(1)  # N processes share two cores
    events: list[tuple[float, ev.Event]] = []
    lock = threading.Lock()

    def on_event(event: ev.Event) -> None:
        with lock:
            events.append((time.monotonic(), event))

    model = _Vector(config.params)
    session = gm.Session(
        model,
        algorithm=gm.Moshpit(sync_every=1, group_size=config.group_size, grid_dims=config.dims),
        mailbox=gm.FileMailbox(root),
        learner_id=f"p{index:03d}",
        round_timeout=config.round_timeout,
        poll_interval=config.poll_interval,
        on_event=on_event,
    )
    mean = (config.peers - 1) / 2.0
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        barrier.wait(timeout=config.timeout)  # every process has joined
        for _ in range(config.warmup):
            session.step()
        with torch.no_grad():
            model.weight.fill_(float(index))
        sq0 = _sq(model.weight, mean)
        before = session.counters()
        barrier.wait(timeout=config.timeout)
        started = time.monotonic()
        for _ in range(config.rounds):
            t0 = time.monotonic()
            try:
                session.step()
            except Exception as exc:  # counted as a failed round
                errors.append(f"{type(exc).__name__}: {exc}")
            t1 = time.monotonic()
            rounds.append({"called": t0, "returned": t1, "sq": _sq(model.weight, mean)})
        after = session.counters()
        barrier.wait(timeout=config.timeout)  # nobody leaves while another may need it
    finally:
        session.close(timeout=config.timeout)
    with lock:
        measured = [e for t, e in events if t >= started]
    return {
        "index": index,
        "sq0": sq0,
        "rounds": rounds,
        "missed": after.missed_groups - before.missed_groups,
        "wait_timeouts": after.wait_timeouts - before.wait_timeouts,
        "errors": errors,
        "lags": [e.lag_s for e in measured if isinstance(e, ev.Applied) and e.contributed],
        "failures": [
            repr(e)
            for e in measured
            if isinstance(e, ev.PublishFailed | ev.RoundFailed | ev.GroupMissed)
        ],
    }


def gradientmail_side(config: GMConfig, workdir: Path) -> Result:
    """N learners (spawned processes, or threads of this one when ``config.processes`` is
    False), each a Session on one FileMailbox under ``workdir``."""
    settings = (
        f"{'processes' if config.processes else 'threads'}, FileMailbox, "
        f"poll_interval {config.poll_interval} s, round_timeout {config.round_timeout} s"
    )
    base = Result(
        "GradientMail", config.peers, config.group_size, config.dims, config.rounds, settings
    )
    root = workdir / f"gm-mailbox-{config.peers}"
    shutil.rmtree(root, ignore_errors=True)
    started = time.monotonic()
    try:
        results = _fleet(config, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    seconds = time.monotonic() - started
    errors = [f"process {i}: {r['error']}" for i, r in sorted(results.items()) if "error" in r]
    missing = [i for i in range(config.peers) if i not in results]
    if errors or missing:
        why = "; ".join(errors[:3]) or f"processes {missing} gave no result"
        return _replace(base, error=why, seconds=seconds)
    ordered = [results[i] for i in range(config.peers)]
    step_s = tuple(r["returned"] - r["called"] for x in ordered for r in x["rounds"])
    failed = sum(x["missed"] + x["wait_timeouts"] + len(x["errors"]) for x in ordered)
    spread_d, spread_k = _spreads(
        [x["sq0"] for x in ordered], [[r["sq"] for r in x["rounds"]] for x in ordered], base.dims
    )
    lags = [lag for x in ordered for lag in x["lags"]]
    notes = [f"Applied.lag_s median {h.secs(statistics.median(lags))}"] if lags else []
    failures = [f for x in ordered for f in x["failures"]]
    if failures:
        notes.append(f"{len(failures)} failure events, e.g. {failures[0][:200]}")
    return _replace(
        base,
        step_s=step_s,
        failed=failed,
        calls=len(step_s),
        spread_d=spread_d,
        spread_k=spread_k,
        seconds=seconds,
        notes=tuple(notes),
    )


def _fleet(config: GMConfig, root: Path) -> dict[int, dict[str, Any]]:
    """Run the learners; each one's record (or ``{"index", "error"}``) by index."""
    barrier: Any
    queue: Any
    workers: list[Any]
    if config.processes:
        # Forked, as hivemind's peers are: this process has imported torch and gradientmail
        # and started no thread, and a child sets one torch thread before any work.
        fork = mp.get_context("fork")
        barrier, queue = fork.Barrier(config.peers), fork.Queue()
        workers = [
            fork.Process(
                target=_gm_learner, args=(i, str(root), config, barrier, queue), daemon=True
            )
            for i in range(config.peers)
        ]
    else:
        barrier, queue = threading.Barrier(config.peers), stdqueue.Queue()
        workers = [
            threading.Thread(
                target=_gm_learner, args=(i, str(root), config, barrier, queue), daemon=True
            )
            for i in range(config.peers)
        ]
    for worker in workers:
        worker.start()
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 4 * config.timeout
    try:
        while len(results) < config.peers and time.monotonic() < deadline:
            try:
                item = queue.get(timeout=1)
            except stdqueue.Empty:
                if not any(w.is_alive() for w in workers):
                    break
                continue
            results[item["index"]] = item
    finally:
        for worker in workers:
            worker.join(timeout=max(1.0, deadline - time.monotonic()))
            if isinstance(worker, mp.process.BaseProcess) and worker.is_alive():
                worker.kill()
                worker.join(timeout=10)
    return results


def _replace(result: Result, **changes: Any) -> Result:
    import dataclasses

    return dataclasses.replace(result, **changes)


# -- hivemind --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HMConfig:
    peers: int
    group_size: int
    params: int
    rounds: int
    warmup: int = 1
    min_matchmaking_time: float = 0.5
    timeout: float = 20.0  # step(timeout=...)
    join_timeout: float = 120.0

    @property
    def dims(self) -> int:
        return dims_of(self.peers, self.group_size)

    @property
    def wall_s(self) -> float:
        """How long the worker may run before it is killed."""
        return 2 * self.join_timeout + (self.rounds + self.warmup) * (self.timeout + 5) + 30


def hivemind_side(config: HMConfig, python: Path | None, reason: str, workdir: Path) -> Result:
    """hivemind's averager at ``config.peers`` peers, run by ``python`` (None: not
    available, because ``reason``)."""
    settings = (
        f"min_matchmaking_time {config.min_matchmaking_time} s, "
        f"request_timeout {config.min_matchmaking_time / 2} s, step timeout {config.timeout} s"
    )
    base = Result("hivemind", config.peers, config.group_size, config.dims, config.rounds, settings)
    if python is None:
        return _replace(base, error=reason)
    command = [
        str(python),
        "-I",  # not the project's path: bench/ must not shadow anything hivemind imports
        str(WORKER),
        "--peers", str(config.peers),
        "--group-size", str(config.group_size),
        "--params", str(config.params),
        "--rounds", str(config.rounds),
        "--warmup", str(config.warmup),
        "--min-matchmaking-time", str(config.min_matchmaking_time),
        "--timeout", str(config.timeout),
        "--join-timeout", str(config.join_timeout),
    ]  # fmt: skip
    log = workdir / f"hivemind-{config.peers}.log"
    started = time.monotonic()
    record, failure = _run_worker(command, log, config.wall_s)
    seconds = time.monotonic() - started
    if record is None:
        return _replace(base, error=failure, seconds=seconds)
    peers = record["peers"]
    errors = [f"peer {p['peer']}: {p['error']}" for p in peers if "error" in p]
    if errors:
        return _replace(base, error=f"{'; '.join(errors[:3])}; {failure}", seconds=seconds)
    step_s = tuple(r["returned"] - r["called"] for p in peers for r in p["rounds"])
    failed = sum(not r["ok"] for p in peers for r in p["rounds"])
    warm_failed = sum(not r["ok"] for p in peers for r in p["warmup"])
    spread_d, spread_k = _spreads(
        [p["sq0"] for p in peers], [[r["sq"] for r in p["rounds"]] for p in peers], base.dims
    )
    notes = [f"{record['started_s']:.1f} s to start the peers"]
    if warm_failed:
        notes.append(f"{warm_failed} of {len(peers)} warm-up steps failed")
    short = sum(1 for p in peers for r in p["rounds"] if r["ok"] and r["group"] < base.group_size)
    if short:
        notes.append(f"{short} steps averaged in a group smaller than M")
    return _replace(
        base,
        step_s=step_s,
        failed=failed,
        calls=len(step_s),
        spread_d=spread_d,
        spread_k=spread_k,
        seconds=seconds,
        notes=tuple(notes),
    )


def _run_worker(command: list[str], log: Path, wall_s: float) -> tuple[dict[str, Any] | None, str]:
    """Run the worker in a session of its own and kill its process group at the end
    (hivemind's DHT and p2pd processes outlive a killed peer); its JSON record and the
    tail of its log, or None and what went wrong."""
    out_path = log.with_suffix(".json")
    with open(log, "w") as err, open(out_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + wall_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            timed_out = proc.poll() is None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    tail = _log_tail(log)
    if timed_out:
        return None, f"the hivemind worker ran past {wall_s:.0f} s: {tail}"
    lines = [x for x in out_path.read_text().splitlines() if x.startswith("{")]
    if not lines:
        return None, f"the hivemind worker exited {proc.returncode} without a result: {tail}"
    record: dict[str, Any] = json.loads(lines[-1])
    return record, tail


def _log_tail(path: Path, lines: int = 4) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])


# -- the table -------------------------------------------------------------------------------


def _spread(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "0" if value == 0 else f"{value:.2e}"


def render(results: Sequence[Result]) -> str:
    """The table (markdown), with a note per result that has one."""
    table = h.Table("Moshpit averaging: hivemind and GradientMail", list(HEADER))
    medians = {(r.system, r.peers): r.median_s for r in results if not r.error}
    notes: list[str] = []
    for r in results:
        ratio = "-"
        if r.system == "GradientMail":
            ratio = h.ratio(r.median_s, medians.get(("hivemind", r.peers), math.nan))
        if r.error:
            table.add(r.system, r.peers, r.group_size, r.dims, r.rounds, "not measured",
                      "-", "-", "-", "-", r.settings)  # fmt: skip
            notes.append(f"- {r.system} at N={r.peers} was not measured: {r.error}")
            continue
        table.add(
            r.system,
            r.peers,
            r.group_size,
            r.dims,
            r.rounds,
            h.secs_range(h.Stats.of(r.step_s)),
            f"{r.failed}/{r.calls}",
            _spread(r.spread_d),
            _spread(r.spread_k),
            ratio,
            r.settings,
        )
        extra = [*r.notes, f"{r.seconds:.0f} s in all"]
        notes.append(f"- {r.system} at N={r.peers}: " + "; ".join(extra))
    return table.render() + ("\n\n" + "\n".join(notes) if notes else "")


# -- main ------------------------------------------------------------------------------------


@dataclass
class Plan:
    peers: tuple[int, ...]
    gm_only: tuple[int, ...] = ()  # N where only GradientMail runs (hivemind would not fit)
    group_size: int = 2
    params: int = 1_000_000
    rounds: int | None = None  # None: d + 2 (quick: d)
    warmup: int = 1
    quick: bool = False
    poll_interval: float = 0.05
    round_timeout: float = 10.0
    min_matchmaking_time: float | None = None  # None: matchmaking_time(N)
    hivemind_timeout: float | None = None  # None: step_timeout(min_matchmaking_time)
    hivemind: bool = True
    hivemind_python: str | None = None
    install: bool = False
    workdir: Path | None = None
    results: list[Result] = field(default_factory=list)

    def rounds_at(self, dims: int) -> int:
        if self.rounds is not None:
            return self.rounds
        return dims if self.quick else dims + 2


def run(plan: Plan) -> list[Result]:
    """Measure both systems at every N of ``plan``; hivemind first at each N."""
    python: Path | None = None
    reason = "skipped (--no-hivemind)"
    if plan.hivemind:
        try:
            python = locate(plan.hivemind_python, install=plan.install)
        except Unavailable as exc:
            reason = str(exc)
            h.progress(f"hivemind is not available: {reason}")
    with contextlib.ExitStack() as stack:
        workdir = plan.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        for n in (*plan.peers, *plan.gm_only):
            dims = dims_of(n, plan.group_size)
            k = plan.rounds_at(dims)
            mmt = plan.min_matchmaking_time or matchmaking_time(n)
            timeout = plan.hivemind_timeout or step_timeout(mmt)
            config = HMConfig(n, plan.group_size, plan.params, k, plan.warmup, mmt, timeout)
            if n in plan.peers:
                h.progress(f"hivemind: N={n}, M={plan.group_size}, {k} rounds")
                hm = hivemind_side(config, python, reason, workdir)
            else:
                hm = hivemind_side(config, None, NOT_RUN, workdir)
            h.progress(f"hivemind: N={n}: {_summary(hm)}")
            h.progress(f"GradientMail: N={n}, M={plan.group_size}, {k} rounds")
            gmr = gradientmail_side(
                GMConfig(
                    n,
                    plan.group_size,
                    plan.params,
                    k,
                    plan.warmup,
                    plan.poll_interval,
                    plan.round_timeout,
                ),
                workdir,
            )
            h.progress(f"GradientMail: N={n}: {_summary(gmr)}")
            plan.results += [hm, gmr]
    return plan.results


def _summary(r: Result) -> str:
    if r.error:
        return f"not measured: {r.error[:300]}"
    return f"median {h.secs(r.median_s)}, failed {r.failed}/{r.calls}, spread {_spread(r.spread_k)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N=4, 100k float32, K=d")
    parser.add_argument("--peers", help="comma-separated N (default 4,8,16,32; quick 4)")
    parser.add_argument(
        "--gm-only-peers", help="N where only GradientMail runs (default 64; quick none)"
    )
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--params", type=h.count, help="default 1M (quick 100k)")
    parser.add_argument("--rounds", type=int, help="K (default d + 2; quick d)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--poll-interval", type=float, default=0.05)
    parser.add_argument("--round-timeout", type=float, default=10.0)
    parser.add_argument("--min-matchmaking-time", type=float)
    parser.add_argument("--hivemind-timeout", type=float, help="step(timeout=...)")
    parser.add_argument("--no-hivemind", action="store_true")
    parser.add_argument("--hivemind-python")
    parser.add_argument(
        "--no-install", action="store_true", help="do not create build/hivemind-venv when missing"
    )
    parser.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = parser.parse_args(argv)
    default_peers = "4" if args.quick else "4,8,16,32"
    plan = Plan(
        peers=tuple(int(x) for x in (args.peers or default_peers).split(",")),
        gm_only=tuple(
            int(x)
            for x in (args.gm_only_peers or ("" if args.quick or args.peers else "64")).split(",")
            if x.strip()
        ),
        group_size=args.group_size,
        params=args.params or (100_000 if args.quick else 1_000_000),
        rounds=args.rounds,
        warmup=args.warmup,
        quick=args.quick,
        poll_interval=args.poll_interval,
        round_timeout=args.round_timeout,
        min_matchmaking_time=args.min_matchmaking_time,
        hivemind_timeout=args.hivemind_timeout,
        hivemind=not args.no_hivemind,
        hivemind_python=args.hivemind_python,
        install=not args.no_install,
    )
    for n in (*plan.peers, *plan.gm_only):
        try:
            dims_of(n, plan.group_size)
        except ValueError as exc:
            parser.error(str(exc))
    info = h.machine()
    started = time.monotonic()
    results = run(plan)
    command = ".venv/bin/python -m bench.moshpit_hivemind " + shlex.join(
        sys.argv[1:] if argv is None else list(argv)
    )
    report = "\n".join(
        [
            f"# {NAME}",
            "",
            f"`{command.strip()}` — {plan.params:,} float32 per process; "
            f"{time.monotonic() - started:.0f} s in all.",
            "",
            f"Machine: {h.describe(info)}",
            "",
            render(results),
            "",
        ]
    )
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
