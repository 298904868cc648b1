"""Benchmark 15 — host memory: the peak resident set a learner costs beyond its training,
at an ordinary learner and at the closer, with the library's own accounting by purpose.

Per configuration (25M and 100M float32 parameters, 1B with ``--large`` where it fits;
``DiLoCo`` with 1 and 4 fragments; 2 and 8 learners; filesystem and SeaweedFS) the learners
are spawned processes on a fresh mailbox, one torch thread each, ``quorum_size`` = learners,
``overlap=0``. Each builds the model (``_workload.build_model``) and plain SGD, makes one
training step, records its resident set (the baseline), joins with a ``gm.Session``, trains
``periods`` sync periods calling ``step()`` after every optimizer step, and closes. The
closer is the learner that closed most rounds. Reference, in the same run: *training
alone*, the same model and loop in a process that never imports gradientmail. Reported:
overhead = peak − training-alone peak (MiB, x model, x fragment); the closer's extra peak;
growth from sync period 5 to the last; ``gm.memory_usage()`` by purpose and what it does
not account for.

Targets (reported, never asserted): learner overhead ≤ 1× model + 2× fragment; the closer's
extra independent of the number of learners; no growth. A configuration runs only if
``MemAvailable`` covers its estimate plus 3 GiB (else "skipped: needs N GiB") and is stopped
when ``MemAvailable`` falls under 1 GiB. Processes: ``_memory_worker.py``; tables and
targets: ``_memory_report.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench import _memory_worker as w
from bench import _procs
from bench._memory_report import model_name, tables, targets

NAME = "memory"
GIB = 1024 * h.MIB
BACKENDS = ("filesystem", "seaweedfs")
TORCH_RUNTIME = 400 * h.MIB  # a process with torch imported, for the a-priori estimates


@dataclass(frozen=True)
class Config:
    models: tuple[int, ...] = (25_000_000, 100_000_000)
    fragments: tuple[int, ...] = (1, 4)
    learners: tuple[int, ...] = (2, 8)
    backends: tuple[str, ...] = BACKENDS
    sync_every: int = 10
    periods: int = 12  # sync periods per configuration (each fragment syncs once a period)
    growth_from: int = 5  # the sync period compared with the last for growth
    batch: int = 8
    poll_interval: float = 0.1
    round_timeout: float = 300.0
    timeout: float = 900.0  # a barrier, a join, a close
    stall_s: float = 300.0  # no news from any process for this long: stacks dumped, stopped
    headroom: int = 3 * GIB
    abort_below: int = 1 * GIB  # MemAvailable under which a running configuration is stopped
    sample_s: float = 0.005


def config_for(ctx: h.Context) -> Config:
    """The preset's sizes, then any ``ctx.options["memory"]`` overrides (tests)."""
    if ctx.quick:
        config = Config(
            models=(2_000_000,), learners=(2,), backends=("filesystem",), periods=10, growth_from=5
        )
    elif ctx.large:
        config = Config(models=(25_000_000, 100_000_000, 1_000_000_000))
    else:
        config = Config()
    return h.overridden(config, ctx.options.get(NAME), {"backends": list(BACKENDS)})


# -- running processes -----------------------------------------------------------------------


def _run(
    config: Config, target: Any, n: int, args: tuple[Any, ...], label: str
) -> list[dict[str, Any]]:
    """``n`` processes ``target`` (a barrier among learners, none for training alone) and
    their results; progress to stderr. They are stopped on an error, on the time limit, or
    when memory runs short."""
    procs, queue, _ = _procs.spawn(target, n, args, "memory", barrier=target is w.learner)
    low = w.mem_available()

    def memory_short() -> str | None:
        nonlocal low
        available = w.mem_available()
        low = min(low, available)
        if available < config.abort_below:
            return f"stopped: MemAvailable fell to {h.size(available)}"
        return None

    def peaks() -> list[str]:  # what the processes reached before they are stopped
        got = [w.proc_bytes(f"/proc/{p.pid}/status", "VmHWM") for p in procs]
        return ["peak RSS so far: " + ", ".join(h.size(x) for x in got)] if any(got) else []

    results, errors = _procs.gather(
        procs, queue, n, label, stall_s=config.stall_s, check=memory_short, on_stop=peaks
    )
    if errors:
        raise RuntimeError("; ".join(errors))
    for item in results:
        item["mem_available_low"] = low
    return results


def _spec(config: Config, params: int, fragments: int, learners: int) -> dict[str, Any]:
    """What a process needs: the configuration's settings for one model and layout."""
    return dataclasses.asdict(config) | dict(params=params, fragments=fragments, learners=learners)


# -- estimates ----------------------------------------------------------------


def _estimate(
    params: int, fragments: int, n: int, alone: dict[str, Any] | None, rows: list[dict[str, Any]]
) -> int:
    """Bytes a configuration needs: a-priori (training alone + 3x the model per learner),
    or, where configurations of this model and fragments already ran, from the one with
    the most learners: its largest learner peak per learner (the closer aside), its
    closer's peak plus a fragment per additional learner."""
    model = params * 4
    training = alone["peak"] if alone else TORCH_RUNTIME + 2 * model
    need = n * (training + 3 * model)
    ran = [
        r
        for r in rows
        if (r["params"], r.get("fragments"), "closer" in r) == (params, fragments, True)
    ]
    if ran:
        row = max(ran, key=lambda r: r["n"])
        learner = max(x["peak"] for x in row["learners"] if x["index"] != row["closer_index"])
        extra = max(0, n - row["n"]) * model // fragments
        need = max(need, (n - 1) * learner + row["closer"]["peak"] + extra)
    return need


# -- the benchmark ---------------------------------------------------------------------------


def _summarize(row: dict[str, Any], alone: dict[str, Any], config: Config) -> None:
    """Add the derived numbers of one configuration to ``row`` (in place)."""
    learners = row["learners"]
    closer = max(learners, key=lambda x: (x["closed"], -x["index"]))
    others = [x for x in learners if x is not closer]
    model = learners[0]["model_bytes"]
    g = min(config.growth_from, config.periods) - 1

    def growth(x: dict[str, Any]) -> int:
        return x["periods"][-1]["peak"] - x["periods"][g]["peak"]

    lives = [(x.get("usage_after_close") or {}).get("live_total") for x in learners]
    peak = h.Stats.of(x["peak"] for x in others)
    row.update(
        closer=closer,
        closer_index=closer["index"],
        model_bytes=model,
        fragment_bytes=model / row["fragments"],
        alone_peak=alone["peak"],
        learner_peak=peak.__dict__,
        learner_base=h.Stats.of(x["rss_base"] for x in others).median,
        learner_overhead=peak.median - alone["peak"],
        closer_overhead=closer["peak"] - alone["peak"],
        closer_extra=closer["peak"] - peak.median,
        learner_growth=max(growth(x) for x in others),
        closer_growth=growth(closer),
        rounds_closed=sum(x["closed"] for x in learners),
        live_after_close=None if None in lives else max(lives),
    )


def _measure(
    ctx: h.Context, config: Config, report: h.Report
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    alones: dict[int, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []

    def skip(row: dict[str, Any], need: int, available: int, what: str) -> bool:
        if need + config.headroom <= available:
            return False
        row["skipped"] = (
            f"skipped: needs {(need + config.headroom) / GIB:.1f} GiB ({what} "
            f"{need / GIB:.1f} + {config.headroom / GIB:.0f} headroom), "
            f"{available / GIB:.1f} GiB available"
        )
        line = f"{row['label']}: {row['skipped']}"
        print(line, flush=True)
        h.progress(line)
        report.notes.append(line)
        return True

    for params in config.models:
        head = {"params": params, "label": f"{model_name(params)} (all configurations)"}
        smallest = min(config.learners)
        need = _estimate(params, max(config.fragments), smallest, None, [])
        if skip(head, need, w.mem_available(), f"{smallest} learners, estimate"):
            rows.append(head)
            continue
        h.progress(f"{model_name(params)} ({h.size(params * 4)}): training alone")
        spec = _spec(config, params, fragments=1, learners=1)  # the model as for 1 fragment
        label = f"{model_name(params)} training alone"
        alones[params] = alone = _run(config, w.alone, 1, (spec,), label)[0]
        grid = itertools.product(config.backends, config.fragments, sorted(config.learners))
        for backend, fragments, n in grid:
            label = f"{model_name(params)} {backend} fragments={fragments} learners={n}"
            row: dict[str, Any] = dict(
                params=params, backend=backend, fragments=fragments, n=n, label=label
            )
            rows.append(row)
            need = _estimate(params, fragments, n, alone, rows)
            if skip(row, need, w.mem_available(), "estimate"):
                continue
            h.progress(f"{label}: starting (estimate {h.size(need)})")
            t0 = time.monotonic()
            try:
                name = f"memory-{model_name(params)}-f{fragments}-n{n}"
                with _procs.store(backend, ctx.workdir, name) as box:
                    spec = _spec(config, params, fragments, n)
                    row["learners"] = _run(config, w.learner, n, (spec, box), label)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                report.notes.append(f"{label}: not measured: {row['error']}")
                continue
            row["seconds"] = time.monotonic() - t0
            _summarize(row, alone, config)
            seen = [x for r in row["learners"] for x in r["failure_events"]]
            if seen:
                report.notes.append(f"{label}: {len(seen)} failure events: {seen[:3]}")
            h.progress(
                f"{label}: done in {row['seconds']:.0f} s; overhead learner "
                f"{h.size(row['learner_overhead'])}, closer {h.size(row['closer_overhead'])}"
            )
    return alones, rows


def run(ctx: h.Context) -> h.Report:
    config = config_for(ctx)
    report = h.Report(
        NAME,
        "15. Host memory: the peak resident set a learner and the closer cost beyond training",
        "training alone: the same model and training loop in a process without a Session "
        "(gradientmail not imported), measured in the same run",
    )
    alones, rows = _measure(ctx, config, report)
    import gradientmail as gm  # not at the top: the training-alone process never imports it

    if not any("closer" in r or "skipped" in r for r in rows):
        raise RuntimeError("; ".join(r.get("error", "") for r in rows) or "nothing measured")
    tables(report, config, alones, rows)
    targets(report, config, [r for r in rows if "closer" in r])
    report.data = {
        "config": dataclasses.asdict(config),
        "ledger": "gm.memory_usage()"
        if hasattr(gm, "memory_usage")
        else "n/a (no gm.memory_usage)",
        "alone": {str(k): v for k, v in alones.items()},
        # The closer is also in "learners" (at "closer_index").
        "configs": [{k: v for k, v in r.items() if k != "closer"} for r in rows],
    }
    return report


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main([NAME, *sys.argv[1:]]))
