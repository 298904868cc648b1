"""``gradientmail run``: a whole run as local processes, with the operator's environment.

Each node is one process in its own process group, started with exactly the variables the
operator puts into a pod (:func:`gradientmail.launch.runspec.node_env`,
:meth:`NodeEnv.to_environ`), so a script that runs here runs on a cluster unchanged. The
mailbox is a fresh ``file://`` directory in the run folder unless ``--mailbox`` names
another (``--mailbox spec`` takes the spec file's, with a fresh prefix under it).

The run folder holds ``mailbox/``, ``logs/{learner}.log`` (each node's output),
``nodes.json`` (pids and process groups) and ``run.yaml`` (the effective resource, which
``kubectl apply`` and ``gradientmail run -f`` both take; its first line and the annotation
``gradientmail.dev/command`` record the command line typed, ``spec.template.command`` the
command after ``--``).

With the built-in node's language model (its default task), the table also shows the
aligned model's validation loss, evaluated here, and a run that succeeds ends with its
curve beside node 0's, ``curves.json`` and ``loss.png`` in the run folder, and a few lines
the aligned model writes (:mod:`gradientmail.demo.report`). ``GRADIENTMAIL_TASK`` and
``GRADIENTMAIL_LM``, the built-in node's own settings, pass from this process's
environment to the nodes; the contract's variables never do.

A mailbox that already holds a run is checked before any node starts:

- the run's manifest against what the nodes would write (the algorithm settings; the
  model's layout too for the built-in node): a difference is one error listing them all;
- the nodes' learner ids: ids someone is beating as right now (their newest beat advances
  within 1.5 beat intervals, 7.5 s at most) belong to another live ``gradientmail run``,
  and are refused with one line naming them and their beats' age. ``--join`` instead adds
  the nodes as new learners, numbered after every learner the mailbox knows. An earlier
  run's learners that left or crashed (beats that stand still) are rejoined.

A node of ``--procs-per-node`` P > 1 (``spec.procsPerNode``) is P local processes with
torchrun's environment and the node's one learner id
(:mod:`gradientmail.launch.ranks`, the same launcher an operator pod runs): its row in the
table follows rank 0, whose output goes to ``logs/{learner}.log``; ranks 1.. write to
``logs/{learner}.rank{R}.log``. The ranks live and die together: one that exits non-zero
has the others stopped and the node counts as failed (restarted whole, below). The
built-in node is one process per node and refuses P > 1.

Ending: a node that exits non-zero is restarted, as the same learner, while the run's
``maxRestarts`` lasts; after that the others are stopped and the failing node's log tail
printed (exit 1). Ctrl-C (or SIGTERM) sends SIGINT to every node's process group, waits
``--stop-timeout`` seconds, then SIGTERM, then SIGKILL (exit 130; a second Ctrl-C skips
the wait).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import queue
import re
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from rich.console import Console
from rich.live import Live
from rich.markup import escape

from gradientmail import settings
from gradientmail import wire as p
from gradientmail.cli._common import (
    USAGE,
    CliError,
    TracebackFolder,
    err,
    mailbox_for,
    out,
    store_error,
)
from gradientmail.cli._nodes import Interrupted, Node, Runner, Watch
from gradientmail.cli._report import status_line, summary
from gradientmail.cli.spec import LOCAL_DEFAULTS, LoadedSpec, load_spec
from gradientmail.cli.table import render_run
from gradientmail.coord.leases import DEFAULT_LEASE_TIMEOUT, beating
from gradientmail.demo.node import NODE_SETTINGS, LmSettings, task_of
from gradientmail.demo.report import AlignedEval, Curve, finish
from gradientmail.errors import MailboxError, ProtocolError
from gradientmail.launch.env import ALGORITHMS, NodeEnv
from gradientmail.launch.runspec import (
    DEFAULT_COMMAND,
    SETTING_FIELDS,
    AlgorithmSpec,
    learner_id,
    mailbox_url,
    node_env,
    ranks_problem,
)
from gradientmail.mailbox import Mailbox
from gradientmail.settings import camel

__all__ = ["add_parser", "run_command"]

POLL = 0.1  # seconds between looks at the processes
COMMAND_ANNOTATION = "gradientmail.dev/command"  # run.yaml: the command line that ran it

# -- arguments -----------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    run = sub.add_parser(
        "run",
        help="run a GradientMailRun as local node processes, with a live table",
        description="Run a GradientMailRun (the operator's file, or flags) as local node "
        "processes that meet only in a mailbox, with the environment the operator injects. "
        "Put a command of your own after `--` (default: the spec's, i.e. the built-in node "
        "`python -m gradientmail.demo.node`; `python` means this interpreter).",
        usage="gradientmail run [-f RUN.yaml] [--nodes N] [--mailbox URL] [options] "
        "[-- COMMAND ...]",
    )
    run.add_argument("-f", "--file", type=Path, help="a GradientMailRun resource, or its spec")
    run.add_argument(
        "--mailbox",
        help="mailbox URL (default: a fresh file:// directory in the run folder); "
        "'spec' uses the file's spec.mailbox with a fresh prefix under it",
    )
    run.add_argument("--name", help="run name: learners are NAME-node-I (metadata.name, local)")
    run.add_argument(
        "--join",
        action="store_true",
        help="add these nodes to the run the mailbox already holds, as new learners (ids "
        "after those it has); without it, a mailbox where learners of the same ids are "
        "live is refused",
    )
    defaults = LOCAL_DEFAULTS["algorithm"]
    group = run.add_argument_group(
        "spec fields (override the file; without one the defaults below apply)"
    )
    group.add_argument("--nodes", type=int, help=f"spec.nodes ({LOCAL_DEFAULTS['nodes']})")
    group.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        help="spec.algorithm.name (diloco): "
        + "; ".join(f"{i.name}: {i.description}" for i in settings.ALGORITHMS.values()),
    )
    # One flag per setting of the registry (gradientmail.settings), typed and described by it.
    for field in SETTING_FIELDS:
        setting = _flag_setting(field)
        default = defaults.get(camel(field), AlgorithmSpec.model_fields[field].default)
        owners = settings.owners(field)
        only = (
            ""
            if len(owners) == len(settings.ALGORITHMS)
            else "; " + "/".join(settings.ALGORITHMS[o].title for o in owners)
        )
        shown = "the algorithm's" if default is None and not setting.nullable else default
        group.add_argument(
            "--" + field.replace("_", "-"),
            type=_parser(setting),
            metavar=field.upper(),
            help=f"spec.algorithm.{camel(field)} ({shown}{only}): {setting.description}",
        )
    group.add_argument(
        "--compression",
        metavar="NAME[:K=V,...]",
        help="spec.algorithm.compression (DiLoCo/SparseLoCo): "
        + ", ".join(
            f"{c.name}:" + ",".join(f"{f.name}={f.default}" for f in c.fields)
            for c in settings.COMPRESSORS.values()
        )
        + ", or none",
    )
    group.add_argument(
        "--lm",
        metavar="K=V,...",
        help="spec.algorithm.lm: the built-in node's model sizes ("
        + ", ".join(settings.LM_SIZES)
        + ")",
    )
    group.add_argument("--max-restarts", type=int, help="spec.maxRestarts (3)")
    procs = settings.LAUNCH["procs_per_node"]
    group.add_argument(
        "--procs-per-node",
        type=_parser(procs),
        metavar="P",
        help=f"spec.procsPerNode ({procs.default}): {procs.description}",
    )
    run.add_argument("--workdir", type=Path, help="run folder (default: a fresh one in $TMPDIR)")
    run.add_argument(
        "--no-live", action="store_true", help="plain output even on a terminal (no table)"
    )
    run.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        help="seconds nodes get to leave after SIGINT before SIGTERM, then SIGKILL (10)",
    )
    run.add_argument(
        "--poll-interval", type=float, default=0.5, help="seconds between mailbox polls (0.5)"
    )


def _flag_setting(field: str) -> settings.Setting:
    if field in settings.SESSION:
        return settings.SESSION[field][0]
    if field in settings.NODE:
        return settings.NODE[field]
    owner = settings.ALGORITHMS[settings.owners(field)[0]]
    return owner.field(field)


def _parser(setting: settings.Setting) -> Any:
    """An argparse ``type=``: the registry's parse (argparse names the flag on an error)."""

    def parse(text: str) -> Any:
        try:
            return setting.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = setting.kind
    return parse


def _fresh_workdir(name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(tempfile.gettempdir()) / "gradientmail"
    base.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", name)
    return Path(tempfile.mkdtemp(prefix=f"{safe}-{stamp}-", dir=base))


def _command(args: argparse.Namespace, loaded: LoadedSpec) -> list[str]:
    template = loaded.spec.template
    command = list(args.command) or [*template.command, *template.args]
    if not command:
        raise CliError("no command to run: the spec's template.command is empty", USAGE)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable  # the interpreter this gradientmail is installed in
    elif shutil.which(command[0]) is None:
        raise CliError(f"command not found: {command[0]!r}", USAGE)
    return command


def _base_environ(loaded: LoadedSpec, processes: int, console: Console) -> dict[str, str]:
    # The contract's variables come from the spec alone; the built-in node's own settings
    # (its task and sizes) pass through from here.
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADIENTMAIL_") or k in NODE_SETTINGS
    }
    for var in loaded.spec.template.env:
        if var.value_from is not None:
            console.print(
                f"[yellow]note[/]: env {escape(var.name)} comes from a Kubernetes source "
                "(valueFrom) and is not set locally"
            )
        elif var.value is not None:
            base[var.name] = var.value
    base["PYTHONUNBUFFERED"] = "1"
    # Several processes (nodes times their ranks) share this machine: each with a thread
    # per core would oversubscribe every core.
    threads = str(max(1, (os.cpu_count() or 1) // processes))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        base.setdefault(name, threads)
    return base


# -- the command ---------------------------------------------------------------------------


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP end the run like Ctrl-C."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _probe(box: Mailbox, url: str) -> p.Manifest | None:
    """Reach the store once (bounded by its timeouts); the run it already holds, if any."""

    async def head() -> bytes | None:
        return await box.get(p.MANIFEST)

    try:
        data = asyncio.run(head())
    except MailboxError as exc:
        raise store_error(url, exc) from None
    if data is None:
        return None
    try:
        return p.decode_manifest(p.MANIFEST, data)
    except ProtocolError as exc:
        raise CliError(f"{url} holds something GradientMail did not write: {exc}") from None


def _builtin(command: Sequence[str]) -> bool:
    """Whether ``command`` (as :func:`_command` made it) runs the built-in node."""
    return list(command) == [sys.executable, *DEFAULT_COMMAND[1:]]


def _check_manifest(
    run: p.Manifest, env: NodeEnv, command: Sequence[str], base: dict[str, str]
) -> None:
    """Refuse nodes that would not match the mailbox's run, before any starts: the
    algorithm settings always, the model's layout when the nodes run the built-in node
    (another command's model is known only to its nodes, which check it themselves)."""
    # What NodeEnv.session gives every node (torch is imported only when there is a run to match).
    algorithm = env.build_algorithm()
    if _builtin(command):
        from gradientmail.demo.node import builtin_model
        from gradientmail.engine.layout import ModelLayout

        mine = ModelLayout(builtin_model(base), algorithm).manifest(env.learner_id, algorithm)
    else:
        mine = dataclasses.replace(run, algorithm=algorithm.settings())
    differences = run.differences(mine)
    if differences:
        raise CliError(
            f"the mailbox holds a run (created by {run.creator}) that these nodes do not "
            "match; give another --mailbox, or the run's own settings:\n  "
            + "\n  ".join(d.replace("this node has", "these nodes have") for d in differences),
            USAGE,
        )


def _learners(box: Mailbox, url: str) -> set[str]:
    """Every learner with a beat in the mailbox, live or not."""

    async def listing() -> Sequence[str]:
        return await box.list(p.LEASES)

    try:
        keys = asyncio.run(listing())
    except MailboxError as exc:
        raise store_error(url, exc) from None
    found = set()
    for key in keys:
        with contextlib.suppress(ProtocolError):
            found.add(p.parse_beat_key(key)[0])
    return found


def _join_offset(name: str, count: int, known: set[str]) -> int:
    """The first index from which ``count`` learner ids of run ``name`` are all unknown."""
    offset = 0
    while any(learner_id(name, offset + i) in known for i in range(count)):
        offset += 1
    return offset


def _check_not_live(box: Mailbox, url: str, learners: list[str], console: Console) -> None:
    """Refuse learner ids another process is beating as (another `gradientmail run` on the
    same mailbox); an earlier run's learners whose beats stopped are rejoined."""

    def watching(watched: list[str], seconds: float) -> None:
        console.print(
            f"checking whether {escape(', '.join(watched))} "
            f"{'is' if len(watched) == 1 else 'are'} still live in the mailbox "
            f"(up to {seconds:.1f} s)…"
        )

    try:
        found = asyncio.run(beating(box, learners, DEFAULT_LEASE_TIMEOUT / 3, watching=watching))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    if found:
        raise CliError(
            "the mailbox holds a run whose learners of the same ids are live: "
            + ", ".join(b.describe() for b in found.values())
            + "; another process is running them (another `gradientmail run`?). "
            "Add these nodes to that run with --join, or use another --mailbox or --name"
        )


def _user_command(args: argparse.Namespace) -> str:
    """The command line the user typed, for run.yaml."""
    argv = sys.argv[1:]
    if argv[:1] != ["run"]:  # called as a function: rebuild it from the arguments
        argv = ["run"]
        for key, value in vars(args).items():
            if key in ("subcommand", "command") or value in (None, False):
                continue
            flag = "--" + key.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        if args.command:
            argv += ["--", *args.command]
    return shlex.join(["gradientmail", *argv])


def run_command(args: argparse.Namespace) -> int:
    console, errors = out(), err()
    for flag in ("stop_timeout", "poll_interval"):
        if getattr(args, flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be positive", USAGE)
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        raise CliError(f"--workdir {args.workdir}: not empty; give a new folder", USAGE)
    name = args.name or "local"
    # Validate the spec before creating anything.
    placeholder = "file:///gradientmail-run/mailbox"
    loaded = load_spec(args.file, vars(args), default_mailbox=placeholder, default_name=name)
    if args.name:
        loaded.resource["metadata"]["name"] = name
    else:
        name = loaded.name
    command = _command(args, loaded)
    problem = ranks_problem(loaded.spec.procs_per_node, command)
    if problem is not None:
        raise CliError(problem, USAGE)
    base = _base_environ(loaded, loaded.spec.nodes * loaded.spec.procs_per_node, errors)
    lm = _lm_settings(base) if _builtin(command) else None
    if args.mailbox == "spec" and not loaded.has_mailbox:
        raise CliError("--mailbox spec: the spec file names no mailbox", USAGE)
    if args.join and args.mailbox in (None, "spec"):
        raise CliError("--join: give the --mailbox URL of the run to join", USAGE)
    if args.mailbox not in (None, "spec"):
        if urlsplit_scheme(args.mailbox) not in ("file", "s3"):
            raise CliError(
                f"--mailbox {args.mailbox}: nodes in separate processes need file:// or s3://",
                USAGE,
            )
        mailbox_for(args.mailbox, create=True)  # a malformed URL fails before anything starts
    workdir = (args.workdir or _fresh_workdir(name)).absolute()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    if args.mailbox is None:
        url = (workdir / "mailbox").as_uri()
    elif args.mailbox == "spec":
        url = mailbox_url(loaded.spec, f"local/{workdir.name}")
    else:
        url = args.mailbox
    spec = loaded.spec
    envs = [node_env(spec, name, i, url) for i in range(spec.nodes)]
    try:
        box = mailbox_for(url, create=True)
        manifest = _probe(box, url)
        if manifest is not None:
            _check_manifest(manifest, envs[0], command, base)
        if args.mailbox not in (None, "spec"):  # a fresh mailbox holds nobody
            if args.join:
                offset = _join_offset(name, spec.nodes, _learners(box, url))
                envs = [
                    dataclasses.replace(env, learner_id=learner_id(name, offset + env.node_index))
                    for env in envs
                ]
            else:
                _check_not_live(box, url, [env.learner_id for env in envs], console)
    except CliError:
        if args.workdir is None:  # nothing ran: leave no empty run folder behind
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    creator = None if manifest is None else manifest.creator
    resource = loaded.resource
    if args.mailbox != "spec":
        resource["spec"]["mailbox"] = {"url": url}
    if args.command:  # what the nodes ran, as the user wrote it
        resource["spec"].setdefault("template", {})
        resource["spec"]["template"]["command"] = list(args.command)
        resource["spec"]["template"]["args"] = []
    typed = _user_command(args)
    resource["metadata"].setdefault("annotations", {})[COMMAND_ANNOTATION] = typed
    (workdir / "run.yaml").write_text(
        f"# written by: {typed}\n" + yaml.safe_dump(resource, sort_keys=False)
    )
    nodes = [Node(i, env, workdir / "logs" / f"{env.learner_id}.log") for i, env in enumerate(envs)]
    console.print(f"[bold]run folder[/] {escape(str(workdir))}")
    console.print(f"[bold]mailbox[/]    {escape(url)}")
    # What the nodes run: the settings their NodeEnv builds the algorithm from.
    console.print(
        f"[bold]nodes[/]      {spec.nodes} × "
        + (f"{spec.procs_per_node} ranks × " if spec.procs_per_node > 1 else "")
        + f"{escape(' '.join(command))}  "
        f"(steps {spec.algorithm.steps}, {escape(spec.algorithm.describe())}, "
        f"maxRestarts {spec.max_restarts})"
    )
    if creator is not None:
        console.print(
            f"[yellow]note[/]: the mailbox already holds a run (created by "
            f"{escape(creator)}); the nodes join it as "
            f"{escape(', '.join(n.learner for n in nodes))}"
        )
    runner = Runner(nodes, command, base, workdir, spec.max_restarts, spec.procs_per_node)
    watch = Watch(box, args.poll_interval)
    live_mode = console.is_terminal and not args.no_live
    started = time.monotonic()

    def committed() -> int | None:
        view = watch.view
        return view.rounds_committed if view is not None and view.exists else None

    aligned = None if lm is None else AlignedEval(url, lm, started, committed)
    failed: Node | None = None
    interrupted: Interrupted | None = None

    def title() -> str:
        return f"{name} · {spec.nodes} nodes · {time.monotonic() - started:,.1f} s"

    def render() -> Any:
        return render_run(
            title(),
            watch.view,
            polls=watch.polls,
            nodes=[n.row() for n in nodes],
            error=watch.error,
            rate=watch.rate.value(),
            notes=() if aligned is None else [aligned.line()],
        )

    # A node's traceback shows as its last line here; the whole of it is in the node's log.
    folders = {
        n.learner: TracebackFolder(f"{n.learner}: ", f" (traceback in {n.log})") for n in nodes
    }

    def relay(print_line: Any) -> None:
        while True:
            try:
                node, line = runner.lines.get_nowait()
            except queue.Empty:
                return
            for shown in folders[node.learner].feed(line):
                print_line(shown)

    live: Live | None = None
    last_status = 0.0
    with _signals_interrupt():
        try:
            watch.start()
            if aligned is not None:
                aligned.start()
            for node in nodes:
                runner.start(node)
            if live_mode:
                live = Live(get_renderable=render, console=console, refresh_per_second=4)
                live.start()
            while True:
                relay(lambda line: console.print(escape(line)))
                failed = runner.reap()
                if failed is not None or all(n.exit_code == 0 for n in nodes):
                    break
                if not live_mode and time.monotonic() - last_status > 5:
                    last_status = time.monotonic()
                    line = status_line(title(), watch.view, watch.rate.value())
                    if aligned is not None:
                        line += f"; {aligned.line().plain}"
                    console.print(escape(line))
                time.sleep(POLL)
        except KeyboardInterrupt:
            interrupted = Interrupted(signal.SIGINT)
        except Interrupted as exc:
            interrupted = exc
        finally:
            if runner.alive():
                if live is None:
                    errors.print(
                        "stopping the nodes…"
                        if failed is None
                        else f"{failed.learner} failed; stopping the others…"
                    )
                runner.stop(args.stop_timeout)
            # After Ctrl-C the nodes' tracebacks are noise here; they are in the logs.
            relay(lambda line: None if interrupted else console.print(escape(line)))
            for folder in folders.values():
                for shown in folder.flush():
                    if not interrupted:
                        console.print(escape(shown))
            watch.finish()
            if aligned is not None:
                aligned.stop()
            if live is not None:
                live.stop()
    if not live_mode:
        console.print(render())
    elapsed = time.monotonic() - started
    if interrupted is not None:
        errors.print(
            f"interrupted ({interrupted}): every node was stopped; logs in "
            f"{escape(str(workdir / 'logs'))}"
        )
        return 128 + interrupted.signum
    if failed is not None:
        folder = TracebackFolder(suffix=" (the traceback is in the log)")
        log, last = failed.failure_tail()
        lines = [shown for line in last for shown in folder.feed(line)] + folder.flush()
        tail = "\n".join(f"  {line}" for line in lines) or "  (no output)"
        rank = failed.failure
        errors.print(
            f"[red]{escape(failed.learner)} failed (exit {failed.exit_code}"
            f"{f' of rank {rank.rank}' if rank is not None and spec.procs_per_node > 1 else ''})"
            f"{' after ' + str(failed.restarts) + ' restarts' if failed.restarts else ''}[/]; "
            f"the last lines of {escape(str(log))}:"
        )
        errors.print(escape(tail))
        return 1
    summary(console, nodes, watch.view, url, elapsed)
    if aligned is not None:
        label = f"{nodes[0].learner}'s model"
        node_curve = Curve(label, [(t - started, v) for t, v in nodes[0].val_curve])
        finish(console, workdir, aligned, node_curve)
    return 0


def _lm_settings(base: dict[str, str]) -> LmSettings | None:
    """The built-in node's language-model settings (None for its synthetic task), checked
    before any node starts."""
    try:
        return LmSettings.from_environ(base) if task_of(base) == "lm" else None
    except ValueError as exc:
        raise CliError(str(exc), USAGE) from None


def urlsplit_scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""
