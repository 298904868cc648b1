"""Spec 004's end-to-end check: node processes train one model through a mailbox while a
checker process recomputes every commit as it lands.

    python examples/synthetic.py                    # 2 nodes, 400 and 100 steps, fresh dir
    python examples/synthetic.py --nodes 3 --steps 300,200,100
    python examples/synthetic.py --mailbox "s3://bucket/run-7?endpoint=http://127.0.0.1:9000"

The script starts itself several times (``sys.executable``, this file, ``--role``):

- one ``checker``, first: it follows ``rounds/`` and calls :func:`gm.verify.verify_commit`
  on every commit before the Session sweeps what it needs (the previous commit of the
  fragment goes ``fragments`` rounds later), printing one line per commit. When told to
  stop (a line or EOF on its stdin) it verifies what is left, loads the newest commits into
  a fresh model with :func:`gm.align` and reports the aligned model's loss;
- ``--nodes`` ``node`` processes: each builds the same 3-layer MLP, draws its own synthetic
  regression data (``--seed`` plus its index), joins with ``gm.Session`` as ``node-{i}``,
  waits at a start barrier until every node joined, then trains ``--steps`` steps,
  calling ``session.step(samples=batch_size)`` after each optimizer step.

With ``--step-delay auto`` every node trains over the same span: the node with the most
steps takes 0.02 s a step and the others proportionally longer (paced against the clock).
The fast node's round then waits for the slow node's snapshot (``round_timeout`` is long
enough), so most rounds combine both; the fast node's extra due steps are skipped while
its fragment is in flight.

The main process prints the checker's lines and a summary table, and exits 1 when a commit
fails verification, fewer than ``--min-rounds`` training rounds committed, align did not load
the newest commit of every fragment, or a process failed or ran past ``--timeout``.
``--role node`` and ``--role checker`` run one process of a run by hand; they print JSON
lines (node) or commit lines plus a final ``RESULT {json}`` line (checker).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.engine.verify import verify_commit
from gradientmail.events import Event, Joined, PollFailed, PublishFailed, RoundFailed
from gradientmail.payload import encode

IN_FEATURES = 16
HIDDEN = 32
TRAIN_SAMPLES = 4096
EVAL_SAMPLES = 1024
AUTO_DELAY = 0.02  # seconds a step of the node with the most steps, under --step-delay auto
RESULT_PREFIX = "RESULT "
BARRIER = "barriers/synthetic-start/"


# -- the model and its data ------------------------------------------------------------------


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(HIDDEN, 1),
    )


def make_data(seed: int, stream: int, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples`` inputs from stream ``stream`` (a node index; -1 is the evaluation set),
    labelled by one teacher that depends on ``seed`` only."""
    teacher = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    w1 = torch.randn(IN_FEATURES, 8, generator=teacher) / IN_FEATURES**0.5
    w2 = torch.randn(8, 1, generator=teacher)
    inputs = torch.Generator().manual_seed(seed * 1_000_003 + 1_000 + stream)
    x = torch.randn(samples, IN_FEATURES, generator=inputs)
    y = torch.tanh(x @ w1) @ w2 + 0.01 * torch.randn(samples, 1, generator=inputs)
    return x, y


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def fragment_keys(model: torch.nn.Module, manifest: p.Manifest) -> list[str]:
    """The payload key each fragment of ``model`` would have: equal to a commit's ``params``
    exactly when the model holds that commit's bytes."""
    params = dict(model.named_parameters())
    return [
        encode({spec.name: params[spec.name].detach() for spec in specs})[0]
        for specs in manifest.fragments
    ]


async def read_manifest(box: gm.Mailbox, timeout: float) -> p.Manifest:
    deadline = time.monotonic() + timeout
    while (data := await box.get(p.MANIFEST)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {p.MANIFEST} in the mailbox after {timeout:.0f} s")
        await asyncio.sleep(0.05)
    return p.decode_manifest(p.MANIFEST, data)


# -- arguments --------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Spec 004's end-to-end check: nodes train through a mailbox, a checker "
        "verifies every commit as it lands, align loads the result.",
    )
    add = parser.add_argument
    add("--role", choices=["main", "node", "checker"], default="main")
    add("--nodes", type=int, default=2, help="node processes (default 2)")
    add("--steps", default="400,100", help="steps per node, comma list or one value")
    add("--sync-every", type=int, default=12, help="DiLoCo sync_every (default 12)")
    add("--fragments", type=int, default=4, help="DiLoCo fragments (default 4)")
    add(
        "--algorithm",
        choices=["diloco", "sparseloco"],
        default="diloco",
        help="gm.DiLoCo (default) or gm.SparseLoCo (top-k contributions, error feedback)",
    )
    add(
        "--dense-every",
        type=int,
        default=1,
        help="SparseLoCo: store a commit's parameters every K rounds of a fragment (default 1)",
    )
    add(
        "--compression",
        default="none",
        help="contributions: none (dense; DiLoCo's default), topk:DENSITY:BITS, bfloat16, "
        "float16, int8 or int4 (SparseLoCo's default: topk:0.02:2)",
    )
    add("--mailbox", help="any URL gm.open_mailbox takes (default: a fresh temp dir)")
    add(
        "--step-delay",
        default="auto",
        help="seconds per step of each node (paced against the clock): comma list, one "
        "value for all, or auto "
        f"(the longest node {AUTO_DELAY} s, the others proportionally longer)",
    )
    add("--seed", type=int, default=0)
    add("--batch-size", type=int, default=32)
    add("--lr", type=float, default=0.05, help="inner SGD learning rate")
    add("--poll-interval", type=float, default=0.05)
    add("--round-timeout", type=float, default=3.0)
    add("--lease-timeout", type=float, default=15.0)
    add("--keep-rounds", type=int, default=2)
    add("--parties", type=int, help="nodes the start barrier waits for (default --nodes)")
    add("--min-rounds", type=int, default=30, help="training rounds expected (default 30)")
    add("--timeout", type=float, default=180.0, help="bound on the whole run, seconds")
    add("--result", type=Path, help="write the summary as JSON here (main role)")
    add("--aligned", type=Path, help="save the aligned parameters (safetensors) here")
    add("--keep", action="store_true", help="keep the default temp mailbox directory")
    add("--index", type=int, default=0, help="node role: which node this is")
    args = parser.parse_args(argv)

    args.steps = _ints(args.steps)
    if len(args.steps) == 1:
        args.steps *= args.nodes
    if len(args.steps) != args.nodes or min(args.steps) < 1:
        parser.error(f"--steps needs one value or {args.nodes} positive values")
    if args.step_delay == "auto":
        longest = max(args.steps)
        args.step_delay = [AUTO_DELAY * longest / steps for steps in args.steps]
    else:
        args.step_delay = _floats(args.step_delay)
        if len(args.step_delay) == 1:
            args.step_delay *= args.nodes
        if len(args.step_delay) != args.nodes:
            parser.error(f"--step-delay needs one value, {args.nodes} values or auto")
    if args.parties is None:
        args.parties = args.nodes
    if args.role != "main" and not args.mailbox:
        parser.error(f"--role {args.role} needs --mailbox")
    if args.mailbox and args.mailbox.startswith("memory:"):
        parser.error("--mailbox: a memory:// mailbox lives in one process; use file:// or s3://")
    if not 0 <= args.index < args.nodes:
        parser.error(f"--index must be in [0, {args.nodes})")
    try:
        algorithm(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def compression(text: str) -> gm.TopK | gm.Cast | gm.Quantize | None:
    """``--compression``'s value as a compressor (ValueError naming a bad one)."""
    if text == "none":
        return None
    if text in ("bfloat16", "float16"):
        return gm.Cast(text)
    if text in ("int8", "int4"):
        return gm.Quantize(bits=int(text[3:]))
    name, _, rest = text.partition(":")
    density, _, bits = rest.partition(":")
    if name != "topk" or not density or not bits:
        raise ValueError(
            f"--compression {text!r}: none, topk:DENSITY:BITS, bfloat16, float16, int8 or int4"
        )
    return gm.TopK(density=float(density), bits=int(bits))


def algorithm(args: argparse.Namespace) -> gm.DiLoCo:
    compressor = compression(args.compression)
    if args.algorithm == "sparseloco":
        if compressor is None:
            compressor = gm.TopK(density=0.02, bits=2)
        return gm.SparseLoCo(
            sync_every=args.sync_every,
            fragments=args.fragments,
            compression=compressor,
            dense_every=args.dense_every,
        )
    if args.dense_every != 1:
        raise ValueError("--dense-every is SparseLoCo's (DiLoCo's momentum is dense)")
    return gm.DiLoCo(sync_every=args.sync_every, fragments=args.fragments, compression=compressor)


# -- node ------------------------------------------------------------------------------------

_print_lock = threading.Lock()


def emit(**record: Any) -> None:
    with _print_lock:
        print(json.dumps(record), flush=True)


async def start_barrier(box: gm.Mailbox, learner: str, parties: int, timeout: float) -> None:
    """Spec 000's Barrier, reduced: record an arrival, wait until ``parties`` arrived."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            await box.put_if_absent(BARRIER + learner, b"")
            if len(await box.list(BARRIER)) >= parties:
                return
        except gm.MailboxUnavailable:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{learner}: fewer than {parties} nodes reached the start")
        await asyncio.sleep(0.05)


def run_node(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    index = args.index
    learner = f"node-{index}"
    steps, delay = args.steps[index], args.step_delay[index]
    box = gm.open_mailbox(args.mailbox)
    model = make_model(args.seed)
    x, y = make_data(args.seed, index, TRAIN_SAMPLES)
    batches = torch.Generator().manual_seed(args.seed * 1_000_003 + 500 + index)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    def on_event(event: Event) -> None:
        if isinstance(event, Joined):
            emit(event="joined-event", learner=learner, rounds=list(event.rounds))
        elif isinstance(event, PollFailed | PublishFailed | RoundFailed):
            emit(event="warning", learner=learner, kind=type(event).__name__, error=str(event))

    with gm.Session(
        model,
        algorithm=algorithm(args),
        mailbox=box,
        learner_id=learner,
        poll_interval=args.poll_interval,
        round_timeout=args.round_timeout,
        lease_timeout=args.lease_timeout,
        keep_rounds=args.keep_rounds,
        on_event=on_event,
    ) as session:
        # The constructor loaded the newest commits; step() has not applied anything yet.
        manifest = asyncio.run(read_manifest(box, 10.0))
        emit(
            event="joined",
            learner=learner,
            pid=os.getpid(),
            creator=session.creator,
            rounds=list(session.rounds),
            params=fragment_keys(model, manifest),
        )
        asyncio.run(start_barrier(box, learner, args.parties, args.timeout))
        emit(event="started", learner=learner)
        loss = float("nan")
        start = time.monotonic()
        for step in range(steps):
            rows = torch.randint(0, TRAIN_SAMPLES, (args.batch_size,), generator=batches)
            optimizer.zero_grad()
            batch_loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
            batch_loss.backward()
            optimizer.step()
            session.step(samples=args.batch_size)
            loss = batch_loss.item()
            # Paced against the clock, so that a busy machine does not stretch the node
            # with the most steps more than the others.
            if (pause := start + (step + 1) * delay - time.monotonic()) > 0:
                time.sleep(pause)
    counters = session.counters()
    emit(
        event="done",
        learner=learner,
        steps=session.steps,
        loss=loss,
        rounds=list(session.rounds),
        published=counters.published,
        closed=counters.closed,
        applied=counters.applied,
        skipped=counters.skipped_syncs,
    )
    return 0


# -- checker ---------------------------------------------------------------------------------


@dataclass
class CheckLog:
    lines: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def _say(text: str) -> None:
    with _print_lock:
        print(text, flush=True)


async def check_new(box: gm.Mailbox, manifest: p.Manifest, newest: list[int], log: CheckLog) -> int:
    """Verify every commit not seen yet; return how many were checked.

    Rounds of different fragments can commit out of order, so the listing starts after the
    oldest per-fragment cursor (as the Session's syncer does) and skips what was seen.
    """
    fragments = manifest.num_fragments
    after = "" if min(newest) < 0 else p.round_key(min(newest))
    checked = 0
    for key in await box.list(p.ROUNDS, after=after):
        r = p.parse_round_key(key)
        if r <= newest[r % fragments]:
            continue
        try:
            verified = await verify_commit(box, r, manifest)
        except Exception as exc:
            log.failures.append(f"round {r}: {exc!r}")
            log.lines.append({"round": r, "fragment": r % fragments, "ok": False})
            _say(f"round {r:5d}  fragment {r % fragments}  FAILED: {exc!r}")
        else:
            who = "+".join(verified.contributors) or "(initial)"
            log.lines.append(
                {
                    "round": r,
                    "fragment": verified.fragment,
                    "contributors": list(verified.contributors),
                    "samples": verified.samples,
                    "initial": verified.initial,
                    "ok": True,
                }
            )
            _say(
                f"round {r:5d}  fragment {verified.fragment}  {who:<16}  "
                f"samples {verified.samples:6d}  OK"
            )
        newest[r % fragments] = r
        checked += 1
    return checked


async def follow(box: gm.Mailbox, args: argparse.Namespace, stop: threading.Event) -> CheckLog:
    manifest = await read_manifest(box, args.timeout)
    log = CheckLog()
    newest = [-1] * manifest.num_fragments
    while not stop.is_set():
        await check_new(box, manifest, newest, log)
        await asyncio.sleep(args.poll_interval / 2)
    await check_new(box, manifest, newest, log)  # what landed before the nodes finished
    return log


def run_checker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    box = gm.open_mailbox(args.mailbox)
    stop = threading.Event()

    def wait_for_stop() -> None:
        sys.stdin.readline()  # a line, or EOF when the main process goes away
        stop.set()

    threading.Thread(target=wait_for_stop, daemon=True).start()
    _say("checker ready")
    log = asyncio.run(follow(box, args, stop))

    manifest = asyncio.run(read_manifest(box, 10.0))
    fragments = manifest.num_fragments
    x, y = make_data(args.seed, -1, EVAL_SAMPLES)
    model = make_model(args.seed + 1)  # a fresh model, initialised differently from the run
    fresh_loss = loss_of(model, x, y)
    aligned = gm.align(model, mailbox=box)
    aligned_loss = loss_of(model, x, y)
    committed = [p.parse_round_key(key) for key in asyncio.run(box.list(p.ROUNDS))]
    newest = {f: max(r for r in committed if r % fragments == f) for f in range(fragments)}
    commits = {
        f: p.decode_commit(p.round_key(r), asyncio.run(box.get(p.round_key(r))))
        for f, r in newest.items()
    }
    loaded = fragment_keys(model, manifest)
    align_ok = dict(aligned) == newest and all(
        loaded[f] == commits[f].params for f in range(fragments)
    )
    if not align_ok:
        log.failures.append(f"align loaded rounds {dict(aligned)}, the newest are {newest}")
    if args.aligned is not None:
        from safetensors.torch import save_file

        save_file({n: t.detach().contiguous() for n, t in model.named_parameters()}, args.aligned)
    training = [line for line in log.lines if line["ok"] and not line["initial"]]
    result = {
        "commits": log.lines,
        "verified": sum(line["ok"] for line in log.lines),
        "failures": log.failures,
        "rounds_committed": sum(1 for r in committed if r >= fragments),
        "training_verified": len(training),
        "align": {"rounds": {str(f): r for f, r in sorted(aligned.items())}, "ok": align_ok},
        "newest": {str(f): r for f, r in newest.items()},
        "params": loaded,
        "fresh_loss": fresh_loss,
        "aligned_loss": aligned_loss,
    }
    _say(
        f"align loaded rounds {[aligned[f] for f in range(fragments)]} "
        f"({'the newest' if align_ok else 'NOT the newest'}); "
        f"eval loss {fresh_loss:.4f} fresh -> {aligned_loss:.4f} aligned"
    )
    _say(RESULT_PREFIX + json.dumps(result))
    return 1 if log.failures else 0


# -- main: start the processes, relay their output, summarise --------------------------------


class ChildFailed(Exception):
    pass


class Child:
    def __init__(self, name: str, argv: list[str], lines: queue.Queue[tuple[str, str | None]]):
        self.name = name
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._thread = threading.Thread(target=self._pump, args=(lines,), daemon=True)
        self._thread.start()

    def _pump(self, lines: queue.Queue[tuple[str, str | None]]) -> None:
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            lines.put((self.name, line.rstrip("\n")))
        lines.put((self.name, None))

    def stop_input(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.stop_input()


def child_argv(args: argparse.Namespace, role: str, index: int = 0) -> list[str]:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        role,
        "--mailbox",
        args.mailbox,
        "--nodes",
        str(args.nodes),
        "--steps",
        ",".join(map(str, args.steps)),
        "--step-delay",
        ",".join(map(str, args.step_delay)),
        "--sync-every",
        str(args.sync_every),
        "--fragments",
        str(args.fragments),
        "--algorithm",
        args.algorithm,
        "--compression",
        args.compression,
        "--dense-every",
        str(args.dense_every),
        "--seed",
        str(args.seed),
        "--batch-size",
        str(args.batch_size),
        "--lr",
        str(args.lr),
        "--poll-interval",
        str(args.poll_interval),
        "--round-timeout",
        str(args.round_timeout),
        "--lease-timeout",
        str(args.lease_timeout),
        "--keep-rounds",
        str(args.keep_rounds),
        "--parties",
        str(args.parties),
        "--timeout",
        str(args.timeout),
        "--index",
        str(index),
    ]
    if role == "checker" and args.aligned is not None:
        argv += ["--aligned", str(args.aligned)]
    return argv


def describe_node(record: dict[str, Any]) -> str | None:
    kind = record.get("event")
    if kind == "joined":
        creator = " (created the run)" if record["creator"] else ""
        return f"joined{creator} at rounds {record['rounds']}"
    if kind == "started":
        return "passed the start barrier"
    if kind == "warning":
        return f"warning: {record['error']}"
    if kind == "done":
        return (
            f"done: {record['steps']} steps, published {record['published']}, "
            f"closed {record['closed']}, applied {record['applied']}, "
            f"skipped {record['skipped']}, last batch loss {record['loss']:.4f}"
        )
    return None


def run_main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    temporary = None
    if not args.mailbox:
        temporary = tempfile.mkdtemp(prefix="gradientmail-synthetic-")
        args.mailbox = Path(temporary).as_uri()
    print(f"mailbox {args.mailbox}", flush=True)
    print(
        f"{args.nodes} nodes, steps {args.steps}, DiLoCo(sync_every={args.sync_every}, "
        f"fragments={args.fragments}), step delay "
        + ", ".join(f"{d:.3f}" for d in args.step_delay)
        + " s",
        flush=True,
    )
    lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
    nodes: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] | None = None
    errors: list[str] = []
    deadline = started + args.timeout

    def drain(until: float, done: set[str], wanted: set[str]) -> None:
        """Relay output until every child in ``wanted`` closed its stdout (or ``until``).

        A node that fails, or a checker that ends before it is told to, stops the run at
        once (the others would wait at the barrier or go unchecked)."""
        nonlocal result
        while not wanted <= done:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{sorted(wanted - done)} still running after {args.timeout} s")
            try:
                name, line = lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                done.add(name)
                status = by_name[name].proc.wait(timeout=30)
                if name == "checker" and "checker" not in wanted:
                    raise ChildFailed(f"the checker ended early (status {status})")
                if name != "checker" and status != 0:
                    raise ChildFailed(f"{name} exited with status {status}")
                continue
            if name == "checker":
                if line.startswith(RESULT_PREFIX):
                    result = json.loads(line.removeprefix(RESULT_PREFIX))
                elif line != "checker ready":
                    print(f"  {line}", flush=True)
                else:
                    done.add("checker-ready")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"{name}: {line}", flush=True)
                continue
            if record.get("event") in ("joined", "done"):
                nodes.setdefault(name, {})[record["event"]] = record
            text = describe_node(record)
            if text:
                print(f"{name}: {text}", flush=True)

    by_name: dict[str, Child] = {}
    interrupted = False
    try:
        checker = by_name["checker"] = Child("checker", child_argv(args, "checker"), lines)
        done: set[str] = set()
        drain(min(deadline, time.monotonic() + 60), done, {"checker-ready"})
        names = [f"node-{i}" for i in range(args.nodes)]
        for i, name in enumerate(names):
            by_name[name] = Child(name, child_argv(args, "node", i), lines)
        drain(deadline, done, set(names))
        checker.stop_input()
        drain(deadline, done, {"checker"})
    except KeyboardInterrupt:
        interrupted = True
    except (TimeoutError, subprocess.TimeoutExpired) as exc:
        errors.append(f"timed out: {exc}")
    except ChildFailed as exc:
        errors.append(str(exc))
    finally:
        for child in by_name.values():
            child.kill()
    elapsed = time.monotonic() - started
    if interrupted:
        print("interrupted: the processes were stopped", file=sys.stderr)
        if temporary is not None and not args.keep:
            shutil.rmtree(temporary, ignore_errors=True)
        return 130

    if result is None:
        errors.append("the checker reported no result")
        result = {}
    summary = summarise(args, result, nodes, errors, elapsed)
    if args.result is not None:
        args.result.write_text(json.dumps(summary, indent=2))
    if temporary is not None:
        if summary["ok"] and not args.keep:
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            print(f"kept {temporary}", flush=True)
    return 0 if summary["ok"] else 1


def summarise(
    args: argparse.Namespace,
    result: dict[str, Any],
    nodes: dict[str, dict[str, Any]],
    errors: list[str],
    elapsed: float,
) -> dict[str, Any]:
    commits = result.get("commits", [])
    training = [c for c in commits if c["ok"] and not c["initial"]]
    every = [c for c in training if len(c["contributors"]) == args.nodes]
    rounds = result.get("rounds_committed", 0)
    failures = list(result.get("failures", []))
    if rounds < args.min_rounds:
        failures.append(f"{rounds} training rounds committed, expected >= {args.min_rounds}")
    failures += errors
    align = result.get("align", {})
    rows = [
        ("mailbox", args.mailbox),
        (
            "nodes",
            ", ".join(
                f"{name} ({info.get('done', {}).get('steps', '?')} steps)"
                for name, info in sorted(nodes.items())
            ),
        ),
        ("training rounds committed", f"{rounds} (expected >= {args.min_rounds})"),
        (
            "  with both nodes" if args.nodes == 2 else f"  with all {args.nodes} nodes",
            str(len(every)),
        ),
        ("  samples committed", str(sum(c["samples"] for c in training))),
        ("commits verified", f"{result.get('verified', 0)} of {len(commits)} seen"),
        ("align loaded rounds", str(align.get("rounds", {}))),
        ("align loaded the newest", "yes" if align.get("ok") else "NO"),
        (
            "eval loss",
            f"{result.get('fresh_loss', float('nan')):.4f} fresh model -> "
            f"{result.get('aligned_loss', float('nan')):.4f} aligned",
        ),
        ("wall time", f"{elapsed:.1f} s"),
        ("result", "OK" if not failures else "FAILED"),
    ]
    width = max(len(name) for name, _ in rows)
    print("\nsummary")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for failure in failures:
        print(f"  FAILURE: {failure}")
    sys.stdout.flush()
    return {
        "ok": not failures,
        "failures": failures,
        "rounds_committed": rounds,
        "rounds_with_all_nodes": len(every),
        "verified": result.get("verified", 0),
        "commits": commits,
        "align": align,
        "newest": result.get("newest", {}),
        "params": result.get("params", []),
        "nodes": nodes,
        "fresh_loss": result.get("fresh_loss"),
        "aligned_loss": result.get("aligned_loss"),
        "elapsed_s": elapsed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "node":
        return run_node(args)
    if args.role == "checker":
        return run_checker(args)
    return run_main(args)


if __name__ == "__main__":
    sys.exit(main())
