"""The tables and targets of ``bench/memory.py`` (benchmark 15, host memory): per
configuration a row dict with the learners' results and what ``memory._summarize`` derived."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import _harness as h

PURPOSES = ("global", "snapshots", "momentum", "encode", "download", "combine")
OVERHEAD_TARGET = "Session overhead <= 1x model + 2x fragment (learner)"
CLOSER_TARGET = "closer's additional peak independent of the number of learners"
GROWTH_TARGET = "no growth over rounds"
KEY = ["mailbox", "model", "fragments", "learners"]
GROWTH = ["learners' growth (MiB)", "closer's growth (MiB)", "rounds closed (closer / all)"]
GROWTH += ["ledger live_total after close", "wall time"]


def model_name(params: int) -> str:
    return f"{params / 1e9:g}B" if params >= 10**9 else f"{params / 1e6:g}M"


def _mib(n: float) -> str:
    return "-" if n != n else f"{n / h.MIB:,.1f}"


def _key(row: dict[str, Any]) -> list[object]:
    return [row["backend"], model_name(row["params"]), row["fragments"], row["n"]]


def _ledger_cells(x: dict[str, Any], overhead: float) -> list[str]:
    """Peak by purpose, idle, peak_total, the RSS overhead, the unaccounted remainder."""
    u = x.get("usage_after_close")
    if u is None:
        return ["n/a"] * (len(PURPOSES) + 2) + [_mib(overhead), "n/a"]
    used = [u["peak"].get(p, 0) for p in PURPOSES] + [u["idle"], u["peak_total"], overhead]
    return [_mib(v) for v in used] + [_mib(overhead - u["peak_total"])]


def _learner_peak(row: dict[str, Any]) -> str:
    lp = h.Stats(**row["learner_peak"])
    return h.size(lp.median) + ("" if lp.n < 2 else f" ({h.size(lp.min)}-{h.size(lp.max)})")


# The peaks table after the configuration's key: (header, cell from a measured row).
PEAKS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("learner before Session", lambda r: h.size(r["learner_base"])),
    ("learner peak", _learner_peak),
    ("learner overhead (MiB)", lambda r: _mib(r["learner_overhead"])),
    ("x model", lambda r: h.ratio(r["learner_overhead"], r["model_bytes"])),
    ("x fragment", lambda r: h.ratio(r["learner_overhead"], r["fragment_bytes"])),
    ("closer peak", lambda r: h.size(r["closer"]["peak"])),
    ("closer overhead (MiB)", lambda r: _mib(r["closer_overhead"])),
    ("x model", lambda r: h.ratio(r["closer_overhead"], r["model_bytes"])),
    ("x fragment", lambda r: h.ratio(r["closer_overhead"], r["fragment_bytes"])),
    ("closer - learner (MiB)", lambda r: _mib(r["closer_extra"])),
]


def tables(
    report: h.Report, config: Any, alones: dict[int, dict[str, Any]], rows: list[dict[str, Any]]
) -> None:
    peak_how = (
        f"Peak RSS: the larger of VmRSS sampled every {config.sample_s * 1000:g} ms "
        "(/proc/self/statm, a background thread) and the kernel's VmHWM (/proc/self/status) "
        "at the end, over the process's life."
    )
    table = report.table(
        "Training alone (the reference): the same model and loop, no Session",
        ["model", "model bytes", "RSS before", "RSS after 1 step", "peak RSS", "peak - before"],
        note=f"{peak_how} 'Before': torch imported, nothing built.",
    )
    for params, a in alones.items():
        sizes = [a["model_bytes"], a["rss_before"], a["rss_base"], a["peak"]]
        table.add(model_name(params), *map(h.size, sizes), h.size(a["peak"] - a["rss_before"]))

    what = (
        f"DiLoCo(sync_every={config.sync_every}), {config.periods} sync periods, overlap=0, "
        f"quorum_size = learners, SGD (no momentum), batch {config.batch}, 1 torch thread"
    )
    table = report.table(
        f"Peak RSS per learner process and at the closer: {what}",
        [*KEY, *(c for c, _ in PEAKS)],
        note=(
            "Overhead = peak RSS - the training-alone peak of the same model. Learner: median "
            "(min-max) over the learners other than the closer; the closer closed most rounds "
            "(Session.counters().closed). 'Before Session': RSS after model + optimizer + one "
            "training step, gradientmail imported. A fragment: model bytes / fragments. " + peak_how
        ),
    )
    for row in rows:
        if "backend" not in row:
            table.add("-", model_name(row["params"]), "-", "-", row["skipped"])
        elif "closer" not in row:
            table.add(*_key(row), row.get("skipped") or f"not measured: {row.get('error')}")
        else:
            table.add(*_key(row), *(cell(row) for _, cell in PEAKS))

    done = [r for r in rows if "closer" in r]
    table = report.table(
        "The library's own accounting (gm.memory_usage() after close): peak by purpose, MiB",
        [*KEY, "who", *PURPOSES, "idle", "peak_total", "RSS overhead", "unaccounted"],
        note=(
            "Peak by purpose and peak_total (the most held at once) from the process's ledger; "
            "idle: pooled bytes kept for reuse at the end (a part of the others). Unaccounted "
            "= RSS overhead (peak - training alone) - peak_total: the allocator (arenas, "
            "fragmentation), imports, threads. Learner: the one with the median peak among "
            "those other than the closer. 'n/a': this checkout has no gm.memory_usage()."
        ),
    )
    for row in done:
        others = sorted(
            (x for x in row["learners"] if x["index"] != row["closer_index"]),
            key=lambda x: x["peak"],
        )
        x = others[(len(others) - 1) // 2]
        overhead = x["peak"] - row["alone_peak"]
        table.add(*_key(row), f"learner-{x['index']}", *_ledger_cells(x, overhead))
        c = row["closer"]
        who = f"closer (learner-{c['index']})"
        table.add(*_key(row), who, *_ledger_cells(c, row["closer_overhead"]))

    g = min(config.growth_from, config.periods)
    table = report.table(
        f"Growth: peak RSS in sync period {g} vs the last ({config.periods}); ledger after close",
        [*KEY, *GROWTH],
        note=(
            f"Growth: the peak RSS within the last sync period minus that within period {g} "
            "(learners: the largest over those other than the closer). live_total: the most "
            "any learner's ledger still held after close() (should be ~0)."
        ),
    )
    for row in done:
        live = row["live_after_close"]
        table.add(
            *_key(row),
            _mib(row["learner_growth"]),
            _mib(row["closer_growth"]),
            f"{row['closer']['closed']} / {row['rounds_closed']}",
            "n/a" if live is None else h.size(live),
            f"{row['seconds']:.0f} s",
        )


def targets(report: h.Report, config: Any, done: list[dict[str, Any]]) -> None:
    if not done:
        for name in (OVERHEAD_TARGET, CLOSER_TARGET, GROWTH_TARGET):
            report.target(name, "not measured", "-", None)
        return

    def limit(r: dict[str, Any]) -> float:
        return r["model_bytes"] + 2 * r["fragment_bytes"]

    worst = max(done, key=lambda r: r["learner_overhead"] / limit(r))
    report.target(
        OVERHEAD_TARGET,
        f"worst {_mib(worst['learner_overhead'])} MiB = "
        f"{h.ratio(worst['learner_overhead'], limit(worst))} the limit "
        f"({_mib(limit(worst))} MiB) at {worst['label']}",
        "<= 1.00x the limit in every configuration",
        all(r["learner_overhead"] <= limit(r) for r in done),
    )

    few, many = min(config.learners), max(config.learners)
    by_key = {(r["params"], r["backend"], r["fragments"], r["n"]): r for r in done}
    pairs = []
    for (params, backend, fragments, n), r in by_key.items():
        s = by_key.get((params, backend, fragments, many))
        if n == few and s is not None and many != few:
            pairs.append((r, s, s["closer_extra"] - r["closer_extra"]))
    if pairs:
        r, s, diff = max(pairs, key=lambda x: x[2] / x[0]["fragment_bytes"])
        report.target(
            f"{CLOSER_TARGET} ({few} vs {many})",
            f"largest change {_mib(diff)} MiB = {h.ratio(diff, r['fragment_bytes'])} a fragment "
            f"({_mib(r['closer_extra'])} -> {_mib(s['closer_extra'])} MiB, {s['label']})",
            "change <= 0.5x a fragment in every pair",
            all(d <= 0.5 * a["fragment_bytes"] for a, _, d in pairs),
        )
    else:
        report.target(
            CLOSER_TARGET,
            "not measured (no configuration measured with both learner counts)",
            "change <= 0.5x a fragment",
            None,
        )

    def allowed(r: dict[str, Any]) -> float:
        return max(8 * h.MIB, 0.05 * r["model_bytes"])

    def grown(r: dict[str, Any]) -> float:
        return max(r["learner_growth"], r["closer_growth"])

    most = max(done, key=lambda r: grown(r) / allowed(r))
    lives = [r["live_after_close"] for r in done if r["live_after_close"] is not None]
    report.target(
        GROWTH_TARGET,
        f"largest {_mib(grown(most))} MiB ({most['label']}); ledger live_total after close "
        + (f"<= {h.size(max(lives))}" if lives else "n/a"),
        "growth <= max(8 MiB, 5% of the model); live_total after close <= 1 MiB",
        all(grown(r) <= allowed(r) for r in done) and all(x <= h.MIB for x in lives),
    )
