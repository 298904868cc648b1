"""The hivemind reference for benchmarks 4 and 5: a blocking averaging round
(``DecentralizedAverager.step()``) of one float32 tensor of 10M parameters between 2 local
processes over loopback, measured once per suite run and shared.

hivemind runs in a venv of its own (``hivemind_setup.py``), driven as a subprocess
(``_hivemind_worker.py``). ``min_matchmaking_time`` is 0.5 s (``request_timeout`` 0.25 s):
the fastest of 0.1 / 0.2 / 0.5 / 1 / 5 s tried on this machine (the default, 5 s, measured
~0.5 s rounds, 0.5 s ~0.3 s), so the reference is hivemind at its best here.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench import _harness as h
from bench.hivemind_setup import Unavailable, locate, run_worker

WORKER = Path(__file__).resolve().parent / "_hivemind_worker.py"
ATTEMPTS = 2  # hivemind's matchmaking sometimes finds no group at all; one retry
ATTEMPT_SECONDS = 150.0


def reference(ctx: h.Context) -> dict[str, Any]:
    """Round times of hivemind's blocking averaging, cached in ``ctx``; raises
    :class:`Unavailable` (with the reason) when hivemind cannot be run."""
    if "hivemind" not in ctx.cache:
        try:
            ctx.cache["hivemind"] = _measure(ctx)
        except Unavailable as exc:
            ctx.cache["hivemind"] = exc
    cached = ctx.cache["hivemind"]
    if isinstance(cached, Unavailable):
        raise cached
    return dict(cached)


def reference_or_note(ctx: h.Context, report: h.Report) -> dict[str, Any] | None:
    """:func:`reference`, or None with the reason among ``report``'s notes."""
    try:
        return reference(ctx)
    except Unavailable as exc:
        report.notes.append(f"hivemind reference not measured: {exc}")
        return None


def _measure(ctx: h.Context) -> dict[str, Any]:
    opts = ctx.options.get("hivemind", {})
    if opts.get("disabled"):
        raise Unavailable("skipped (--no-hivemind)")
    python = locate(opts.get("python"))
    params, rounds, warmup = 10_000_000, ctx.pick(8, 4), 2
    h.progress(f"hivemind: {warmup} + {rounds} averaging rounds of {params / 1e6:.0f}M float32")
    command = [str(python), "-I", str(WORKER), "--params", str(params), "--rounds",
               str(rounds), "--warmup", str(warmup), "--min-matchmaking-time", "0.5"]  # fmt: skip
    out: dict[str, Any] | None = None
    failure = ""
    for attempt in range(1, ATTEMPTS + 1):
        out, failure = run_worker(command, ctx.workdir / f"hivemind-{attempt}.log", ATTEMPT_SECONDS)
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
    for a, b in zip(peers[0]["rounds"][warmup:], peers[1]["rounds"][warmup:], strict=True):
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
