"""The hivemind reference for benchmarks 4 and 5: a blocking averaging round
(``DecentralizedAverager.step()``) of one float32 tensor of 10M parameters between 2 local
processes over loopback, measured once per suite run and shared.

hivemind runs in a venv of its own (see ``hivemind_setup.py``), driven as a subprocess
(``_hivemind_worker.py``). ``min_matchmaking_time`` is 0.5 s (``request_timeout`` 0.25 s):
the fastest of 0.1 / 0.2 / 0.5 / 1 / 5 s tried on this machine (the default, 5 s, measured
~0.5 s rounds, 0.5 s ~0.3 s), so the reference is hivemind at its best here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench import _harness as h
from bench.hivemind_setup import Unavailable, locate

WORKER = Path(__file__).resolve().parent / "_hivemind_worker.py"


def reference(ctx: h.Context) -> dict[str, Any]:
    """Round times of hivemind's blocking averaging, cached in ``ctx``; raises
    :class:`Unavailable` (with the reason) when hivemind cannot be run."""
    cached = ctx.cache.get("hivemind")
    if isinstance(cached, Unavailable):
        raise cached
    if cached is not None:
        return dict(cached)
    try:
        result = _measure(ctx)
    except Unavailable as exc:
        ctx.cache["hivemind"] = exc
        raise
    ctx.cache["hivemind"] = result
    return dict(result)


def _measure(ctx: h.Context) -> dict[str, Any]:
    opts = ctx.options.get("hivemind", {})
    if opts.get("disabled"):
        raise Unavailable("skipped (--no-hivemind)")
    python = locate(opts.get("python"))
    params = 10_000_000
    rounds = ctx.pick(8, 4)
    warmup = 2
    h.progress(f"hivemind: {warmup} + {rounds} averaging rounds of {params / 1e6:.0f}M float32")
    command = [
        str(python),
        "-I",  # not the project's path: bench/ must not shadow anything hivemind imports
        str(WORKER),
        "--params",
        str(params),
        "--rounds",
        str(rounds),
        "--warmup",
        str(warmup),
        "--min-matchmaking-time",
        "0.5",
    ]
    out: dict[str, Any] | None = None
    failure = ""
    for attempt in range(1, ATTEMPTS + 1):
        log = ctx.workdir / f"hivemind-{attempt}.log"
        out, failure = _attempt(command, log)
        if out is not None and any(
            a["ok"] and b["ok"]
            for a, b in zip(
                out["peers"][0].get("rounds", [])[warmup:],
                out["peers"][1].get("rounds", [])[warmup:],
                strict=False,
            )
        ):
            break
        h.progress(f"hivemind: attempt {attempt} of {ATTEMPTS} failed: {failure[:300]}")
    if out is None:
        raise Unavailable(failure)
    peers = out["peers"]
    errors = [p["error"] for p in peers if "error" in p]
    if errors:
        raise Unavailable(f"hivemind peers failed: {errors}; {failure}")
    per_peer: list[float] = []
    both: list[float] = []
    agree = True
    failed = 0
    first, second = peers[0]["rounds"], peers[1]["rounds"]
    for a, b in zip(first[warmup:], second[warmup:], strict=True):
        if not (a["ok"] and b["ok"]):
            failed += 1
            continue
        per_peer += [a["returned"] - a["called"], b["returned"] - b["called"]]
        both.append(max(a["returned"], b["returned"]) - max(a["called"], b["called"]))
        agree &= abs(a["first"] - b["first"]) < 1e-3 and abs(a["last"] - b["last"]) < 1e-3
    if not both:
        raise Unavailable(f"no hivemind round succeeded; {failure}")
    return {
        "version": out["hivemind"],
        "torch": out["torch"],
        "python": str(python),
        "params": params,
        "rounds": len(both),
        "failed_rounds": failed,
        "peers_agree": agree,
        "step_s": per_peer,  # per process: how long step() blocked its caller
        "round_s": both,  # from both having called step() to both having returned
        "round_median_s": statistics.median(both),
    }


ATTEMPTS = 2  # hivemind's matchmaking sometimes finds no group at all; one retry
ATTEMPT_SECONDS = 150.0


def _attempt(command: list[str], log: Path) -> tuple[dict[str, Any] | None, str]:
    """Run the worker once; return its JSON record (or None) and what went wrong.

    The worker runs in a session of its own and the whole process group is killed at the
    end: hivemind forks DHT and p2pd processes that outlive a killed peer, and would
    otherwise keep running (and, were stdout a pipe, keep the parent waiting for EOF)."""
    out_path = log.with_suffix(".json")
    with open(log, "w") as err, open(out_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + ATTEMPT_SECONDS
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            timed_out = proc.poll() is None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    if timed_out:
        return None, f"the hivemind worker ran past {ATTEMPT_SECONDS:.0f} s: {_log_tail(log)}"
    lines = [x for x in out_path.read_text().splitlines() if x.startswith("{")]
    if not lines:
        return None, f"the worker exited {proc.returncode} without a result: {_log_tail(log)}"
    record: dict[str, Any] = json.loads(lines[-1])
    errors = [p["error"] for p in record["peers"] if "error" in p]
    if errors:
        return None, f"hivemind peers failed: {errors}; {_log_tail(log)}"
    return record, _log_tail(log)


def _log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])
