"""``python -m bench [NAMES] [--quick] [--large] [--json out.json]``: run the suite.

Each benchmark prints its tables (medians and min–max over repetitions, and the ratio to a
reference measured in the same run) and its targets as it finishes; progress goes to stderr.
The whole record (machine, load, every number) is written as JSON, by default to
``bench/results/<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h

# name -> module, in the order the suite runs them.
BENCHMARKS: dict[str, str] = {
    "payload": "bench.payload",
    "combine": "bench.combine",
    "rounds": "bench.rounds",
    "step": "bench.step_cost",
    "sync": "bench.sync_time",
    "idle": "bench.idle_cost",
    "scale": "bench.scale",
    "mailbox": "bench.mailbox",
    "quality": "bench.quality",
    "utilization": "bench.utilization",
    "memory": "bench.memory",
    "operator": "bench.operator_load",
    "averaging": "bench.averaging",
}
DEFAULT = [
    "payload",
    "combine",
    "rounds",
    "step",
    "sync",
    "idle",
    "scale",
    "quality",
    "utilization",
    "memory",
]


def run_suite(
    names: Sequence[str],
    *,
    quick: bool = False,
    large: bool = False,
    options: dict[str, Any] | None = None,
    json_path: Path | None = None,
    md_path: Path | None = None,
) -> int:
    """Run ``names`` in suite order; print each report; write JSON to ``json_path`` and the
    reports' Markdown to ``md_path``."""
    info = h.machine()
    started = time.monotonic()
    preset = "quick" if quick else "large" if large else "default"
    print(f"# gradientmail benchmarks ({preset} sizes)\n")
    print(f"Machine: {h.describe(info)}\n")
    reports: list[h.Report] = []
    with tempfile.TemporaryDirectory(prefix="gm-bench-") as tmp:
        ctx = h.Context(quick=quick, large=large, workdir=Path(tmp), options=options or {})
        for name in names:
            module = importlib.import_module(BENCHMARKS[name])
            h.progress(f"== {name}: starting")
            t0 = time.monotonic()
            # Each benchmark starts on a quiet machine: the previous one's garbage collected
            # and its dirty pages written back (the gigabytes `rounds` writes otherwise slow
            # the fsyncs of the next ones for seconds).
            gc.collect()
            os.sync()
            try:
                report: h.Report = module.run(ctx)
            except Exception as exc:
                traceback.print_exc()
                report = h.Report(name, name, "-", error=f"{type(exc).__name__}: {exc}")
            report.seconds = time.monotonic() - t0
            reports.append(report)
            h.progress(f"== {name}: done in {report.seconds:.0f} s")
            print(report.render(), flush=True)
            print()
    info["load_average_after"] = list(os.getloadavg())
    total = time.monotonic() - started

    print("## Summary of targets\n")
    for report in reports:
        if report.error:
            print(f"- {report.name}: ERROR {report.error}")
        for tg in report.targets:
            print(f"- [{tg.verdict}] {report.name}: {tg.name}: {tg.measured} (target {tg.goal})")
    load_after = ", ".join(f"{x:.2f}" for x in info["load_average_after"])
    print(f"\nSuite: {total:.0f} s; load average at the end {load_after}")

    record = {
        "suite": "gradientmail bench",
        "preset": preset,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(total, 1),
        "machine": info,
        "options": options or {},
        "benchmarks": {r.name: r.to_json() for r in reports},
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
        print(f"JSON: {json_path}")
    if md_path is not None:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        head = f"Machine: {h.describe(info)}; load average at the end {load_after}; {total:.0f} s"
        md_path.write_text("\n\n".join([head, *(r.render() for r in reports)]) + "\n")
        print(f"markdown: {md_path}")
    return 1 if any(r.error for r in reports) else 0


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return repr(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="GradientMail's benchmarks against the physical limits and against "
        "hivemind, each beside a reference measured in the same run.",
    )
    parser.add_argument(
        "names",
        nargs="*",
        help=f"benchmarks to run (default: {' '.join(DEFAULT)}; also: mailbox, operator)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small sizes: under 3 minutes")
    size.add_argument("--large", action="store_true", help="the issue's full ranges (slow)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the record")
    parser.add_argument("--no-json", action="store_true", help="write no JSON record")
    parser.add_argument(
        "--hivemind-python",
        default=None,
        help="the Python of a venv with hivemind (default: $GRADIENTMAIL_HIVEMIND_PYTHON, "
        "else build/hivemind-venv, created on first use; see python -m bench.hivemind_setup)",
    )
    parser.add_argument(
        "--no-hivemind", action="store_true", help="skip the hivemind reference (no install)"
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, module in BENCHMARKS.items():
            doc = (importlib.import_module(module).__doc__ or "").strip().splitlines()
            print(f"{name:8} {doc[0] if doc else ''}")
        return 0
    names = args.names or DEFAULT
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}")
    ordered = [n for n in BENCHMARKS if n in names]
    json_path = None
    if not args.no_json:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        json_path = args.json or h.ROOT / "bench" / "results" / f"{stamp}.json"
    options: dict[str, Any] = {
        "hivemind": {"python": args.hivemind_python, "disabled": args.no_hivemind},
        # Where the record goes: benchmarks that write files beside it (quality's plot).
        "json_path": str(json_path) if json_path is not None else None,
    }
    return run_suite(
        ordered, quick=args.quick, large=args.large, options=options, json_path=json_path
    )


if __name__ == "__main__":
    sys.exit(main())
