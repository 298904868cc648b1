"""``gradientmail demo``: the bare mailbox coordination, without training.

It starts several node processes that never talk to each other: they
elect a creator, line up at a barrier and split a queue of work units, all through
``put_if_absent`` and ``list`` on one mailbox (a fresh directory unless ``--mailbox`` names
another store), then prints who did what. It is the smallest proof that a mailbox is
enough to coordinate a run; the training Session builds on exactly these operations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradientmail.cli._common import plain
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.url import open_mailbox

__all__ = ["add_parser", "run"]

_POLL = 0.05


async def _demo_node(
    box: Mailbox, learner: str, nodes: int, units: int, deadline: float
) -> dict[str, object]:
    creator = await box.put_if_absent("claims/creator", learner.encode())
    await box.put_if_absent(f"barriers/start/{learner}", b"")
    while len(await box.list("barriers/start/")) < nodes:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{learner}: not every node reached the start barrier in time")
        await asyncio.sleep(_POLL)
    won = []
    for unit in range(units):
        if await box.put_if_absent(f"units/{unit:04d}", learner.encode()):
            won.append(unit)
            await asyncio.sleep(0.05)  # "process" the unit; the others claim the next ones
    return {"learner": learner, "creator": creator, "units": won}


def _run_node(args: argparse.Namespace) -> int:
    box = open_mailbox(args.mailbox)
    result = asyncio.run(
        _demo_node(box, args.learner, args.nodes, args.units, time.monotonic() + args.timeout)
    )
    print(json.dumps(result), flush=True)
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.units < 0:
        print("gradientmail demo: --nodes must be >= 1 and --units >= 0", file=sys.stderr)
        return 2
    url = args.mailbox or Path(tempfile.mkdtemp(prefix="gradientmail-demo-")).as_uri()
    try:
        box = open_mailbox(url)  # validates the URL before any node starts
    except ValueError as exc:
        print(f"gradientmail demo: {exc}", file=sys.stderr)
        return 2
    print(f"mailbox: {url}")
    print(f"starting {args.nodes} node processes; they share nothing but the mailbox\n")
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gradientmail.cli",
                "_demo-node",
                "--mailbox",
                url,
                "--learner",
                f"node-{i}",
                "--nodes",
                str(args.nodes),
                "--units",
                str(args.units),
                "--timeout",
                str(args.timeout),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(args.nodes)
    ]
    results = []
    failed = False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=args.timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            failed = True
            print(f"a node failed (exit {proc.returncode}):\n{err[-2000:]}", file=sys.stderr)
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    if failed:
        return 1
    elapsed = time.monotonic() - started
    print(f"{'node':<10} {'creator':<8} {'units won'}")
    for result in sorted(results, key=lambda r: str(r["learner"])):
        units = result["units"]
        assert isinstance(units, list)
        print(
            f"{result['learner']!s:<10} {'yes' if result['creator'] else '':<8} "
            f"{len(units):>3}  {units}"
        )
    claimed = sorted(u for r in results for u in r["units"])
    creators = sum(1 for r in results if r["creator"])
    keys = asyncio.run(box.list(""))
    ok = claimed == list(range(args.units)) and creators == 1
    print(
        f"\n{len(keys)} objects in the mailbox; exactly one creator: {creators == 1}; "
        f"every unit claimed exactly once: {claimed == list(range(args.units))} "
        f"({elapsed:.1f} s)"
    )
    return 0 if ok else 1


def add_parser(sub: Any) -> None:
    demo = sub.add_parser(
        "demo",
        help="coordinate a few local processes through a mailbox (no training)",
        description=plain(__doc__.split("\n\n")[1]),
    )
    demo.add_argument("--nodes", type=int, default=3, help="node processes to start (3)")
    demo.add_argument("--units", type=int, default=12, help="work units to split (12)")
    demo.add_argument("--mailbox", help="mailbox URL (default: a fresh file:// directory)")
    demo.add_argument("--timeout", type=float, default=60.0, help="seconds before giving up")
    node = sub.add_parser("_demo-node")
    for flag in ("--mailbox", "--learner"):
        node.add_argument(flag, required=True)
    node.add_argument("--nodes", type=int, required=True)
    node.add_argument("--units", type=int, required=True)
    node.add_argument("--timeout", type=float, required=True)


def run(args: argparse.Namespace) -> int:
    if args.subcommand == "demo":
        return _run_demo(args)
    return _run_node(args)
