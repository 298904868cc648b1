"""Moshpit averaging, hivemind's against GradientMail's, at N processes of this machine.

Both systems average one float32 tensor of ``--params`` elements (1M; ``--quick`` 100k)
held by N processes in groups of M = 2 on a full grid of d = log2 N dimensions, for
K = d + 2 measured rounds (``--quick``: d) after one untimed warm-up round; N = 4, 8, 16, 32
for both and 64 for GradientMail alone (``--gm-only-peers``); ``--quick``: N = 4. Process
``i`` starts at ``float(i)`` and after each round reports its squared distance to the
initial global mean. Per system and N: **s per round** (how long each ``step()`` blocked,
median (min–max) over rounds and processes, a failed step with the time it took);
**failed** (hivemind: steps that returned None or raised; GradientMail: ``missed_groups``,
wait time-outs and exceptions; out of N·K); **spread after d / after K** (Σ_i ||x_i − x̄||²
over its value before the first round: exactly 0 after d rounds on a full grid of full
groups); **GradientMail/hivemind** (the ratio of the medians).

**hivemind** (1.1.12, its own venv: ``hivemind_setup.py``): ``_hivemind_moshpit_worker.py``
forks N peers, each its own ``hivemind.DHT`` and a ``DecentralizedAverager(target_group_size
=M, min_group_size=2, initial_group_bits=...)`` on the grid of hivemind's
``test_allreduce_grid``. ``min_matchmaking_time`` (``request_timeout`` half of it) is 0.5 s
at N <= 4, 2 s at N = 8, 16 and 5 s above, ``step(timeout=max(20 s, 6 of them))``: the
fastest that found groups on this 2-core machine (N=16 at 0.5 s found none; N=32 at 2 s
failed 154 of 160 steps). A peer is four processes; 32 held ~9 GiB, so hivemind stops at 32.

**GradientMail**: N processes forked from this one (``GMConfig(processes=False)``: threads,
the test's cheaper fleet), each a ``gm.Session`` on one Parameter of ``--params`` float32,
``gm.Moshpit(sync_every=1, group_size=M, grid_dims=d)``, ``gm.FileMailbox`` (fsync on),
``round_timeout`` 10 s, ``poll_interval`` 0.05 s; with ``overlap=0`` every ``step()`` waits
for its group's commit. Both sides run one torch thread per process.

    .venv/bin/python -m bench.moshpit_hivemind [--quick] [--peers 4,8,16,32]
        [--gm-only-peers 64] [--params 1M] [--rounds K] [--out FILE.md] [--no-hivemind]
        [--hivemind-python PATH] [--no-install]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing as mp
import queue as stdqueue
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gradientmail as gm
from bench import _harness as h
from bench import _procs
from bench.hivemind_setup import Unavailable, locate, run_worker
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


def _measured(base: Result, per_peer: Sequence[dict[str, Any]], **changes: Any) -> Result:
    """``base`` with the step times and spreads of ``per_peer`` (each ``sq0`` and ``rounds``
    of ``called``, ``returned``, ``sq``): spread after a round = Σ sq / Σ sq0."""
    step_s = tuple(r["returned"] - r["called"] for p in per_peer for r in p["rounds"])
    initial = sum(p["sq0"] for p in per_peer)
    spread_d = spread_k = math.nan
    if initial > 0 and per_peer[0]["rounds"]:
        after = [
            sum(p["rounds"][r]["sq"] for p in per_peer) / initial
            for r in range(len(per_peer[0]["rounds"]))
        ]
        spread_d = after[base.dims - 1] if len(after) >= base.dims else math.nan
        spread_k = after[-1]
    return dataclasses.replace(
        base, step_s=step_s, calls=len(step_s), spread_d=spread_d, spread_k=spread_k, **changes
    )


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
    events = _procs.Events()
    model = _Vector(config.params)
    session = gm.Session(
        model,
        algorithm=gm.Moshpit(sync_every=1, group_size=config.group_size, grid_dims=config.dims),
        mailbox=gm.FileMailbox(root),
        learner_id=f"p{index:03d}",
        round_timeout=config.round_timeout,
        poll_interval=config.poll_interval,
        on_event=events,
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
    failed_kinds = ("PublishFailed", "RoundFailed", "GroupMissed")
    return {
        "index": index,
        "sq0": sq0,
        "rounds": rounds,
        "missed": after.missed_groups - before.missed_groups,
        "wait_timeouts": after.wait_timeouts - before.wait_timeouts,
        "errors": errors,
        "lags": [e.lag_s for t, e in events.of(ev.Applied) if t >= started and e.contributed],
        "failures": events.failures(failed_kinds, since=started),
    }


def gradientmail_side(config: GMConfig, workdir: Path) -> Result:
    """N learners (forked processes, or threads of this one when ``config.processes`` is
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
        return dataclasses.replace(base, error=why, seconds=seconds)
    ordered = [results[i] for i in range(config.peers)]
    lags = [lag for x in ordered for lag in x["lags"]]
    notes = [f"Applied.lag_s median {h.secs(statistics.median(lags))}"] if lags else []
    failures = [f for x in ordered for f in x["failures"]]
    if failures:
        notes.append(f"{len(failures)} failure events, e.g. {failures[0][:200]}")
    failed = sum(x["missed"] + x["wait_timeouts"] + len(x["errors"]) for x in ordered)
    return _measured(base, ordered, failed=failed, seconds=seconds, notes=tuple(notes))


def _fleet(config: GMConfig, root: Path) -> dict[int, dict[str, Any]]:
    """Run the learners; each one's record (or ``{"index", "error"}``) by index. Processes
    are forked, as hivemind's peers are: this process has imported torch and gradientmail
    and started no thread, and a child sets one torch thread before any work."""
    fork = mp.get_context("fork")
    barrier: Any = (
        fork.Barrier(config.peers) if config.processes else threading.Barrier(config.peers)
    )
    queue: Any = fork.Queue() if config.processes else stdqueue.Queue()
    kind: Any = fork.Process if config.processes else threading.Thread
    workers = [
        kind(target=_gm_learner, args=(i, str(root), config, barrier, queue), daemon=True)
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
        return dataclasses.replace(base, error=reason)
    options = {
        "peers": config.peers,
        "group-size": config.group_size,
        "params": config.params,
        "rounds": config.rounds,
        "warmup": config.warmup,
        "min-matchmaking-time": config.min_matchmaking_time,
        "timeout": config.timeout,
        "join-timeout": config.join_timeout,
    }
    # -I: not the project's path (bench/ must not shadow anything hivemind imports).
    command = [str(python), "-I", str(WORKER)]
    command += [x for key, value in options.items() for x in (f"--{key}", str(value))]
    started = time.monotonic()
    log = workdir / f"hivemind-{config.peers}.log"
    record, failure = run_worker(command, log, config.wall_s, lines=4)
    seconds = time.monotonic() - started
    if record is None:
        return dataclasses.replace(base, error=failure, seconds=seconds)
    peers = record["peers"]
    errors = [f"peer {p['peer']}: {p['error']}" for p in peers if "error" in p]
    if errors:
        error = f"{'; '.join(errors[:3])}; {failure}"
        return dataclasses.replace(base, error=error, seconds=seconds)
    notes = [f"{record['started_s']:.1f} s to start the peers"]
    warm_failed = sum(not r["ok"] for p in peers for r in p["warmup"])
    if warm_failed:
        notes.append(f"{warm_failed} of {len(peers)} warm-up steps failed")
    short = sum(1 for p in peers for r in p["rounds"] if r["ok"] and r["group"] < base.group_size)
    if short:
        notes.append(f"{short} steps averaged in a group smaller than M")
    failed = sum(not r["ok"] for p in peers for r in p["rounds"])
    return _measured(base, peers, failed=failed, seconds=seconds, notes=tuple(notes))


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
        key = [r.system, r.peers, r.group_size, r.dims, r.rounds]
        if r.error:
            table.add(*key, "not measured", "-", "-", "-", "-", r.settings)
            notes.append(f"- {r.system} at N={r.peers} was not measured: {r.error}")
            continue
        ratio = "-"
        if r.system == "GradientMail":
            ratio = h.ratio(r.median_s, medians.get(("hivemind", r.peers), math.nan))
        table.add(*key, h.secs_range(h.Stats.of(r.step_s)), f"{r.failed}/{r.calls}",
                  _spread(r.spread_d), _spread(r.spread_k), ratio, r.settings)  # fmt: skip
        notes.append(
            f"- {r.system} at N={r.peers}: " + "; ".join([*r.notes, f"{r.seconds:.0f} s in all"])
        )
    return table.render() + ("\n\n" + "\n".join(notes) if notes else "")


# -- main ------------------------------------------------------------------------------------


def run(plan: argparse.Namespace, workdir: Path | None = None) -> list[Result]:
    """Measure both systems at every N of ``plan`` (:func:`main`'s options, ``peers`` and
    ``gm_only`` as tuples); hivemind first at each N."""
    results: list[Result] = []
    python: Path | None = None
    reason = "skipped (--no-hivemind)"
    if not plan.no_hivemind:
        try:
            python = locate(plan.hivemind_python, install=not plan.no_install)
        except Unavailable as exc:
            reason = str(exc)
            h.progress(f"hivemind is not available: {reason}")
    with contextlib.ExitStack() as stack:
        workdir = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        for n in (*plan.peers, *plan.gm_only):
            dims = dims_of(n, plan.group_size)
            k = plan.rounds if plan.rounds is not None else dims if plan.quick else dims + 2
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
            gm_config = GMConfig(n, plan.group_size, plan.params, k, plan.warmup,
                                 plan.poll_interval, plan.round_timeout)  # fmt: skip
            gmr = gradientmail_side(gm_config, workdir)
            h.progress(f"GradientMail: N={n}: {_summary(gmr)}")
            results += [hm, gmr]
    return results


def _summary(r: Result) -> str:
    if r.error:
        return f"not measured: {r.error[:300]}"
    return f"median {h.secs(r.median_s)}, failed {r.failed}/{r.calls}, spread {_spread(r.spread_k)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="N=4, 100k float32, K=d")
    add("--peers", help="comma-separated N (default 4,8,16,32; quick 4)")
    add("--gm-only-peers", help="N where only GradientMail runs (default 64; quick none)")
    add("--group-size", type=int, default=2)
    add("--params", type=h.count, help="default 1M (quick 100k)")
    add("--rounds", type=int, help="K (default d + 2; quick d)")
    add("--warmup", type=int, default=1)
    add("--poll-interval", type=float, default=0.05)
    add("--round-timeout", type=float, default=10.0)
    add("--min-matchmaking-time", type=float)
    add("--hivemind-timeout", type=float, help="step(timeout=...)")
    add("--no-hivemind", action="store_true")
    add("--hivemind-python")
    add("--no-install", action="store_true", help="do not create build/hivemind-venv")
    add("--out", type=Path, help="also write the report (markdown) here")
    args = parser.parse_args(argv)
    gm_only = args.gm_only_peers or ("" if args.quick or args.peers else "64")
    args.peers = tuple(
        int(x) for x in (args.peers or ("4" if args.quick else "4,8,16,32")).split(",")
    )
    args.gm_only = tuple(int(x) for x in gm_only.split(",") if x.strip())
    args.params = args.params or (100_000 if args.quick else 1_000_000)
    for n in (*args.peers, *args.gm_only):
        try:
            dims_of(n, args.group_size)
        except ValueError as exc:
            parser.error(str(exc))
    info = h.machine()
    started = time.monotonic()
    results = run(args)
    command = "python -m bench.moshpit_hivemind " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    report = "\n\n".join([
        f"# {NAME}",
        f"`.venv/bin/{command.strip()}` — {args.params:,} float32 per process; "
        f"{time.monotonic() - started:.0f} s in all.",
        f"Machine: {h.describe(info)}",
        render(results),
    ]) + "\n"  # fmt: skip
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
