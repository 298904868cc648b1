"""The hivemind reference for benchmarks 4 and 5: a blocking averaging round
(``DecentralizedAverager.step()``) of one float32 tensor of 10M parameters between 2 local
processes over loopback, measured once per suite run and shared.

hivemind runs in a venv of its own (see ``hivemind_setup.py``), driven as a subprocess
(``_hivemind_worker.py``). ``min_matchmaking_time`` is 0.5 s (``request_timeout`` 0.25 s):
the fastest of 0.1 / 0.2 / 0.5 / 1 / 5 s tried on this machine (the default, 5 s, measured
~0.5 s rounds, 0.5 s ~0.3 s), so the reference is hivemind at its best here.
"""

from __future__ import annotations

import json
import statistics
import subprocess
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
    log = ctx.workdir / "hivemind.log"
    try:
        with open(log, "w") as err:
            done = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=err, text=True, timeout=300, check=False
            )
    except subprocess.TimeoutExpired as exc:
        raise Unavailable(f"the hivemind worker timed out: {_log_tail(log)}") from exc
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise Unavailable(
            f"the hivemind worker exited {done.returncode} without a result: {_log_tail(log)}"
        )
    out = json.loads(lines[-1])
    peers = out["peers"]
    errors = [p["error"] for p in peers if "error" in p]
    if errors:
        raise Unavailable(f"hivemind peers failed: {errors}; {_log_tail(log)}")
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
        raise Unavailable(f"no hivemind round succeeded; {_log_tail(log)}")
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


def _log_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:])
