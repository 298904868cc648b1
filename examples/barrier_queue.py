"""Spec 000's loop with several node processes: start barrier, Session, a Shared Queue of
work units, done barrier, align, evaluate.

    python examples/barrier_queue.py                     # 3 nodes, 12 units, fresh directory
    python examples/barrier_queue.py --nodes 4 --units 20
    python examples/barrier_queue.py --crash             # node-0 dies mid-unit and restarts
    python examples/barrier_queue.py --mailbox "s3://bucket/run-8?endpoint=http://127.0.0.1:9000"

(from the repository root, with the project's environment: ``.venv/bin/python …``). The
script starts itself once per node (``sys.executable``, this file, ``--role node``); the
processes share nothing but the mailbox, a fresh directory unless ``--mailbox`` names one
(a new run needs a new, empty prefix). Each node:

1. builds the same small regression model (its own random initialisation) and joins the
   run with ``gm.Session``, which loads the run's committed parameters;
2. waits at ``Barrier.wait("start", parties=nodes)``: every node starts training from the
   same parameters, within one ``poll_interval`` of the last node's arrival;
3. trains on the batches of ``shared_queue(units, …)``: the units are shards of synthetic
   data named ``shard-00`` …; each is claimed by one node (``units/{id}``), loaded on a
   background thread, and marked done (``units-done/{id}``) once trained on;
4. closes the Session (its rounds in flight commit), waits at ``Barrier.wait("done")``,
   loads the newest commits with ``gm.align`` and evaluates the model on held-out data.

With ``--crash``, node-0 exits abruptly (``os._exit``) in the middle of its second unit.
The launcher restarts it with the same learner ID, as the Kubernetes operator would: the
restarted node rejoins, passes the start barrier at once (its arrival is still there) and
re-owns its unfinished unit, unless another node re-claimed it first after its queue
lease lapsed. Either way every unit is done exactly once.

The launcher relays each node's lines, prints a table of who did what, and exits 1 when a
node failed, a unit was not done exactly once, or the nodes' aligned models differ.
``--role node`` runs one node by hand (it prints JSON lines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import gradientmail as gm
from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.shared_queue import DONE, shared_queue

FEATURES = 8
BATCH = 32
LEASE = 3.0  # seconds; short so that a crashed node's units move on quickly


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def true_weights() -> torch.Tensor:
    return torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0))


def make_data(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator)
    y = torch.tanh(x @ true_weights()) + 0.05 * torch.randn(rows, 1, generator=generator)
    return x, y


def unit_ids(count: int) -> list[str]:
    return [f"shard-{i:02d}" for i in range(count)]


# -- one node ----------------------------------------------------------------------------------


def run_node(args: argparse.Namespace) -> int:
    name = f"node-{args.index}"
    t0 = args.t0 or time.time()  # the launcher's start, so that every node's times compare

    def say(event: str, **fields: Any) -> None:
        line = {"node": name, "t": round(time.time() - t0, 2), "event": event}
        print(json.dumps(line | fields), flush=True)

    box = gm.open_mailbox(args.mailbox)
    model = make_model(seed=args.index)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    barrier = Barrier(mailbox=box, learner_id=name, poll_interval=0.2)
    crash_in = args.crash_after  # batches until this node dies (-1: never)

    def load(unit: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = make_data(seed=1000 + int(unit.rsplit("-", 1)[1]), rows=args.batches * BATCH)
        for start in range(0, len(x), BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]

    session = gm.Session(
        model,
        algorithm=gm.DiLoCo(sync_every=8, fragments=2),
        mailbox=box,
        learner_id=name,
        poll_interval=0.1,
        round_timeout=0.5,
        lease_timeout=LEASE,
    )
    say("joined", creator=session.creator, rounds=list(session.rounds))
    opened = barrier.wait("start", parties=args.nodes, timeout=args.timeout)
    say("start barrier opened", arrived=opened)
    steps = 0
    with session:
        queue = shared_queue(
            unit_ids(args.units),
            mailbox=box,
            learner_id=name,
            load=load,
            prefetch=4,
            poll_interval=0.2,
            lease_timeout=LEASE,
        )
        with queue:
            for x, y in queue:
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                session.step(samples=len(x))
                steps += 1
                if steps == crash_in:
                    say("crashing", loaded=list(queue.loaded), done=list(queue.completed))
                    os._exit(3)  # no close, no leaving beat: what a killed pod leaves behind
                time.sleep(0.02)  # a slower "GPU", so the nodes overlap
        say(
            "queue finished",
            loaded=list(queue.loaded),
            reclaimed=list(queue.reclaimed),
            steps=steps,
        )
    arrived = barrier.wait("done", parties=args.nodes, timeout=args.timeout)
    rounds = gm.align(model, mailbox=box)
    x, y = make_data(seed=999, rows=2048)
    with torch.no_grad():
        evaluation = torch.nn.functional.mse_loss(model(x), y).item()
    published = sum(1 for e in session.events if isinstance(e, gm.events.Published))
    say(
        "evaluated",
        done_arrived=arrived,
        aligned_rounds=rounds,
        eval_mse=round(evaluation, 6),
        published=published,
        steps=steps,
        loaded=list(queue.loaded),
        reclaimed=list(queue.reclaimed),
    )
    return 0


# -- the launcher ------------------------------------------------------------------------------


def _spawn(
    args: argparse.Namespace, url: str, index: int, crash_after: int
) -> subprocess.Popen[str]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        "node",
        "--index",
        str(index),
        "--nodes",
        str(args.nodes),
        "--units",
        str(args.units),
        "--batches",
        str(args.batches),
        "--mailbox",
        url,
        "--timeout",
        str(args.timeout),
        "--crash-after",
        str(crash_after),
        "--t0",
        str(args.t0),
    ]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _relay(
    proc: subprocess.Popen[str], results: dict[int, list[dict[str, Any]]], index: int
) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            print(f"  node-{index}: {line.rstrip()}", flush=True)
            continue
        results.setdefault(index, []).append(entry)
        hidden = ("node", "t", "event", "loaded", "reclaimed", "steps", "published")
        details = {
            k: v for k, v in entry.items() if k not in hidden or entry["event"] != "evaluated"
        }
        details = {k: v for k, v in details.items() if k not in ("node", "t", "event")}
        shown = " ".join(f"{k}={v}" for k, v in details.items())
        print(f"  {entry['t']:6.2f}s {entry['node']:<7} {entry['event']:<21} {shown}", flush=True)


def launch(args: argparse.Namespace) -> int:
    url = args.mailbox or Path(tempfile.mkdtemp(prefix="gradientmail-barrier-queue-")).as_uri()
    box = gm.open_mailbox(url)
    print(f"mailbox: {url}")
    print(f"{args.nodes} node processes, {args.units} units of {args.batches} batches\n")
    args.t0 = time.time()
    results: dict[int, list[dict[str, Any]]] = {}
    procs: dict[int, subprocess.Popen[str]] = {}
    relays: list[threading.Thread] = []

    def start(index: int, crash_after: int) -> None:
        proc = procs[index] = _spawn(args, url, index, crash_after)
        relay = threading.Thread(target=_relay, args=(proc, results, index), daemon=True)
        relay.start()
        relays.append(relay)

    for index in range(args.nodes):
        start(index, crash_after=args.batches + 3 if args.crash and index == 0 else -1)
    failed = []
    restarted = False
    deadline = time.monotonic() + args.timeout + 60
    while procs:
        for index, proc in list(procs.items()):
            code = proc.poll()
            if code is None:
                continue
            del procs[index]
            if code == 3 and args.crash and not restarted:
                restarted = True
                print(f"  launcher: node-{index} died (exit {code}); restarting it", flush=True)
                start(index, crash_after=-1)
            elif code != 0:
                assert proc.stderr is not None
                failed.append(f"node-{index} exit {code}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            for proc in procs.values():
                proc.kill()
            failed.append("timed out")
            break
        time.sleep(0.05)
    for relay in relays:
        relay.join(timeout=10)
    if failed:
        print("\n".join(failed), file=sys.stderr)
        return 1
    return summarize(args, box, results, time.time() - args.t0)


def summarize(
    args: argparse.Namespace,
    box: gm.Mailbox,
    results: dict[int, list[dict[str, Any]]],
    elapsed: float,
) -> int:
    finals = {index: entries[-1] for index, entries in results.items()}
    header = f"{'node':<8}{'units loaded':<44}{'steps':>6}{'published':>10}{'eval mse':>10}"
    print(f"\n{header}")
    for index in sorted(finals):
        final = finals[index]
        loaded = [u.removeprefix("shard-") for u in final["loaded"]]
        reclaimed = set(final["reclaimed"])
        shown = " ".join(f"{u}*" if f"shard-{u}" in reclaimed else u for u in loaded)
        print(
            f"node-{index:<3}{shown:<44}{final['steps']:>6}{final['published']:>10}"
            f"{final['eval_mse']:>10.4f}"
        )
        for crash in (e for e in results[index] if e["event"] == "crashing"):
            lost = [u.removeprefix("shard-") for u in crash["loaded"] if u not in crash["done"]]
            print(
                f"        (before its restart it finished {len(crash['done'])} unit(s) and "
                f"crashed holding {' '.join(lost) or 'nothing'})"
            )

    async def markers() -> dict[str, dict[str, Any]]:
        keys = await box.list(DONE)
        return {key[len(DONE) :]: json.loads(await box.get(key) or b"{}") for key in keys}

    done = asyncio.run(markers())
    units = unit_ids(args.units)
    problems = []
    if sorted(done) != units:
        problems.append(f"units not done: {sorted(set(units) - set(done))}")
    losses = {round(final["eval_mse"], 6) for final in finals.values()}
    if len(losses) != 1:
        problems.append(f"the aligned models differ: eval mse {sorted(losses)}")
    rounds = {json.dumps(final["aligned_rounds"], sort_keys=True) for final in finals.values()}
    if len(rounds) != 1:
        problems.append(f"align loaded different rounds: {sorted(rounds)}")
    owners = " ".join(
        f"{unit.removeprefix('shard-')}:{marker.get('learner')}"
        for unit, marker in sorted(done.items())
    )
    print(f"\n(* = re-claimed)  {len(done)} done markers for {len(units)} units: {owners}")
    print(f"aligned rounds {next(iter(rounds))}; {elapsed:.1f} s in all")
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--units", type=int, default=12)
    parser.add_argument("--batches", type=int, default=8, help="batches per unit")
    parser.add_argument("--mailbox", help="a mailbox URL (default: a fresh directory)")
    parser.add_argument("--timeout", type=float, default=120.0, help="barrier timeouts, s")
    parser.add_argument("--crash", action="store_true", help="node-0 dies mid-unit, restarts")
    parser.add_argument("--role", choices=["launcher", "node"], default="launcher")
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--crash-after", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.units < 1 or args.batches < 1:
        parser.error("--nodes, --units and --batches must be >= 1")
    if args.role == "node":
        if not args.mailbox:
            parser.error("--role node needs --mailbox")
        return run_node(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
