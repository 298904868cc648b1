"""Does a run the README's way train one model? Four nodes against one node alone.

    python examples/classify_check.py                       # the installed GradientMail
    python examples/classify_check.py --library /tmp/gm-old # another checkout of it

It runs, each step bounded by ``--timeout``:

1. ``gradientmail run --nodes 4 --steps 800 --sync-every 25 --fragments 2 -- python
   examples/classify.py --out RESULTS``: four nodes, each on its own shard of the data
   (``examples/classify.py`` says what the data and the model are);
2. ``gradientmail status URL --json``: per learner, the sync points reached, contributed,
   skipped and the seconds waited at them. A library too old to report them there is read
   from the counters each node saved (reached = contributed + skipped);
3. the same training on each shard alone, without GradientMail (``classify.py --alone``);
4. ``classify.py --evaluate``, a separate process: ``gm.align`` from the run's mailbox into
   a fresh model, and every saved model, on the same held-out test set.

It prints one table of test accuracy and loss (the aligned model, each node's own model
after its last local step, each shard trained alone, chance) and one of sync points per
node, and exits 1 when the aligned model is less accurate than the best node alone, or a
step failed. ``--library DIR`` runs every step with ``PYTHONPATH=DIR`` and ``DIR`` as the
working directory (the nodes inherit both), so that tree's library and CLI are used; the
nodes print which one they imported and the check refuses a mismatch. The run folder
(``--workdir``, default a fresh temporary one) keeps the mailbox, the node logs, the saved
models and ``check.json`` with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "classify.py"


class CheckFailed(Exception):
    pass


class Tree:
    """Which GradientMail to run: the installed one, or a checkout given by path."""

    def __init__(self, library: Path | None) -> None:
        self.library = library
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTMAIL_")}
        self.env["PYTHONUNBUFFERED"] = "1"
        if library is None:
            self.cwd = HERE.parent
            self.env.pop("PYTHONPATH", None)
            script = Path(sys.executable).with_name("gradientmail")
            self.cli = (
                [str(script)] if script.exists() else [sys.executable, "-m", "gradientmail.cli"]
            )
        else:
            # The working directory comes first on `python -m`'s path: make it the tree.
            self.cwd = library
            self.env["PYTHONPATH"] = str(library)
            self.cli = [sys.executable, "-m", "gradientmail.cli"]

    def package(self) -> str:
        return str((self.library or HERE.parent) / "gradientmail" / "__init__.py")

    def run(self, args: list[str], timeout: float, what: str) -> str:
        try:
            done = subprocess.run(
                args,
                cwd=self.cwd,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{what}: no result within {timeout:.0f} s") from None
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise CheckFailed(f"{what}: exit {done.returncode}\n{tail}")
        return done.stdout


def run_nodes(tree: Tree, args: argparse.Namespace, workdir: Path) -> float:
    """``gradientmail run`` with the script; its output goes to ``workdir/run.out``."""
    command = [
        *tree.cli,
        "run",
        "--nodes",
        str(args.nodes),
        "--steps",
        str(args.steps),
        "--sync-every",
        str(args.sync_every),
        "--fragments",
        str(args.fragments),
        "--no-live",
        "--workdir",
        str(workdir / "run"),
        "--",
        "python",
        str(SCRIPT),
        "--out",
        str(workdir / "results"),
    ]
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    with open(workdir / "run.out", "w") as log:
        proc = subprocess.Popen(
            command, cwd=tree.cwd, env=tree.env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # gradientmail run stops every node on SIGINT
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise CheckFailed(
                f"gradientmail run: not done within {args.timeout:.0f} s; see {log.name}"
            ) from None
    seconds = time.monotonic() - started
    if code != 0:
        tail = "\n".join((workdir / "run.out").read_text().splitlines()[-20:])
        raise CheckFailed(f"gradientmail run: exit {code}\n{tail}")
    return seconds


def sync_points(tree: Tree, url: str, workdir: Path, timeout: float) -> tuple[list[dict], str]:
    """Per learner: reached, contributed, skipped, waited; and where they came from."""
    status = json.loads(tree.run([*tree.cli, "status", url, "--json"], timeout, "status"))
    (workdir / "status.json").write_text(json.dumps(status, indent=1))
    reports = {
        r["learner"]: r
        for r in (json.loads(p.read_text()) for p in sorted((workdir / "results").glob("*.json")))
    }
    for learner, report in reports.items():
        if report["library"] != tree.package():
            raise CheckFailed(f"{learner} imported {report['library']}, not {tree.package()}")
    rows = []
    from_status = all("sync_points" in x for x in status["learners"])
    for learner in status["learners"]:
        report = reports.get(learner["learner"], {})
        if from_status:
            row = {k: learner[k] for k in ("sync_points", "contributed", "skipped", "waited_s")}
        else:
            published = report.get("published", 0)
            skipped = report.get("skipped_syncs", 0)
            row = {
                "sync_points": published + skipped,
                "contributed": published,
                "skipped": skipped,
                "waited_s": None,
            }
        rows.append({"learner": learner["learner"], "steps": learner["steps"], **row})
    source = (
        "gradientmail status --json"
        if from_status
        else "the nodes' own counters (this status --json has no sync-point fields)"
    )
    return rows, source


def train_alone(args: argparse.Namespace, workdir: Path) -> None:
    """Each shard trained alone, as many at a time as there are cores."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTMAIL_")}
    env["OMP_NUM_THREADS"] = "1"
    queue = list(range(args.nodes))
    running: list[tuple[int, subprocess.Popen[bytes], float]] = []
    deadline = time.monotonic() + args.timeout
    while queue or running:
        while queue and len(running) < max(1, os.cpu_count() or 1):
            shard = queue.pop(0)
            command = [
                sys.executable,
                str(SCRIPT),
                "--alone",
                *("--shard", str(shard), "--shards", str(args.nodes)),
                *("--steps", str(args.steps), "--save", str(workdir / f"alone-{shard}.pt")),
            ]
            proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
            running.append((shard, proc, time.monotonic()))
        shard, proc, _ = running.pop(0)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, other, _ in [(shard, proc, 0.0), *running]:
                other.kill()
                other.wait()
            raise CheckFailed(f"training alone: not done within {args.timeout:.0f} s") from None
        if code != 0:
            raise CheckFailed(f"training shard {shard} alone: exit {code}")


def evaluate(tree: Tree, url: str, workdir: Path, timeout: float) -> dict[str, dict]:
    models = [*sorted((workdir / "results").glob("*.pt")), *sorted(workdir.glob("alone-*.pt"))]
    command = [sys.executable, str(SCRIPT), "--evaluate", "--aligned", url]
    command += [f"--model={path}" for path in models]
    lines = tree.run([*command, "--timeout", str(timeout)], timeout + 60, "evaluate")
    return {row["model"]: row for row in map(json.loads, lines.splitlines())}


def report(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    scores, rows = result["scores"], result["sync"]
    alone = [scores[f"alone-{i}"] for i in range(args.nodes)]
    locals_ = [scores[r["learner"]] for r in rows if r["learner"] in scores]
    aligned = scores["aligned"]

    def line(name: str, accuracy: float, loss: float) -> None:
        print(f"  {name:<56} {accuracy:>8.3f} {loss:>9.3f}")

    def spread(name: str, group: list[dict]) -> None:
        accuracy = [g["accuracy"] for g in group]
        loss = [g["loss"] for g in group]
        mean = sum(accuracy) / len(accuracy), sum(loss) / len(loss)
        line(f"{name}, mean of {len(group)}", *mean)
        print(
            f"  {'':<56} {min(accuracy):.3f}–{max(accuracy):.3f} "
            f"{min(loss):.3f}–{max(loss):.3f}  (range)"
        )

    print()
    print(
        f"GradientMail {result['library']} · {args.nodes} nodes × {args.steps} steps, "
        f"syncEvery {args.sync_every}, fragments {args.fragments} · run {result['run_s']:.1f} s"
    )
    heading = f"model (test set: {result['test_size']} snippets)"
    print(f"  {heading:<56} {'accuracy':>8} {'loss':>9}")
    rounds = ", ".join(f"{k}: {v}" for k, v in sorted(aligned["rounds"].items()))
    line(f"aligned after the run (gm.align; rounds {rounds})", aligned["accuracy"], aligned["loss"])
    spread("each node's own model after its last step", locals_)
    spread("one node alone on its shard, same steps", alone)
    line("chance", scores["chance"]["accuracy"], scores["chance"]["loss"])
    print()
    print(f"  sync points per node (from {result['sync_source']}):")
    columns = ("steps", 6), ("reached", 8), ("contributed", 12), ("skipped", 8), ("waited s", 9)
    print(f"  {'learner':<14} " + " ".join(f"{name:>{width}}" for name, width in columns))
    for r in rows:
        waited = "—" if r["waited_s"] is None else f"{r['waited_s']:.1f}"
        print(
            f"  {r['learner']:<14} {r['steps']:>6} {r['sync_points']:>8} "
            f"{r['contributed']:>12} {r['skipped']:>8} {waited:>9}"
        )
    best = max(alone, key=lambda g: g["accuracy"])
    ok = aligned["accuracy"] >= best["accuracy"]
    print()
    print(
        f"  aligned {aligned['accuracy']:.3f} vs the best node alone {best['accuracy']:.3f}: "
        f"{'at least as good' if ok else 'WORSE'} "
        f"({aligned['accuracy'] - best['accuracy']:+.3f})"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", type=Path, help="a GradientMail checkout to run instead")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--sync-every", type=int, default=25)
    parser.add_argument("--fragments", type=int, default=2)
    parser.add_argument("--workdir", type=Path, help="a new folder for everything (default: fresh)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on each step (s)")
    args = parser.parse_args(argv)
    library = None if args.library is None else args.library.resolve()
    tree = Tree(library)
    if args.workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="gm-classify-check-"))
    else:
        workdir = args.workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=False)
    url = (workdir / "run" / "mailbox").as_uri()
    try:
        run_s = run_nodes(tree, args, workdir)
        rows, source = sync_points(tree, url, workdir, args.timeout)
        train_alone(args, workdir)
        scores = evaluate(tree, url, workdir, args.timeout)
    except CheckFailed as exc:
        print(f"classify_check: {exc}", file=sys.stderr)
        return 1
    result = {
        "library": tree.package().removesuffix("/__init__.py"),
        "run_s": run_s,
        "sync": rows,
        "sync_source": source,
        "scores": scores,
        "test_size": scores["chance"].get("test_size", "?"),
        "workdir": str(workdir),
    }
    (workdir / "check.json").write_text(json.dumps(result, indent=1))
    ok = report(args, result)
    print(f"  everything in {workdir} (check.json, run.out, run/logs/)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
