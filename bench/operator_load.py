"""Operator load: API-server requests per run per minute, for running and finished runs, for
N = 1, 10, 100 runs at once; and how long a failed pod waits for its replacement when the
store hangs.

On the project's Kubernetes API server stand-in (``testbed/kube``), with a timed log of every
request, the operator runs as a real ``kopf run --standalone --all-namespaces`` of
``operator/gradientmail_operator/handlers.py`` from ``--source`` (default: this checkout;
``gradientmail`` and ``gradientmail_operator`` are imported from there, checked before the
start), with its default settings (every ``GRADIENTMAIL_OPERATOR_*`` variable removed).

No kubelet: node pods never start. The benchmark writes their status as a kubelet would
(``Running`` and ready; later ``Succeeded``, exit 0), so that the runs reach phase Running and
then Succeeded the ordinary way, through the operator. The mailbox is S3 (a credentials
Secret, as in production) on a stand-in that answers like an empty bucket (``--mailbox
closed``: a port nobody listens on; ``--mailbox file``: a file:// mailbox, no Secret).

For each N: N runs of ``--nodes`` pods; once every run is Running, a warm-up, then a window of
``--minutes`` during which the operator's requests are counted by resource and verb; then all
pods Succeeded, every run Succeeded, a warm-up, and the same window again. Requests the
benchmark makes itself (its own User-Agent) are left out; everything else (kopf's watches,
discovery, CRD scanning) is counted and divided by N.

Pod replacement (``--replace-reps``, 0 skips it): one run of 2 pods on a working store, then
on a hanging one (accepts connections, never answers); a pod is marked Failed and the time
until a new pod of that index exists is measured, bounded by ``--replace-timeout``.

Targets (issue 16): ≤ 1 request/min per finished run, ≤ 10/min per running run beyond pod
changes; a hanging store does not delay pod replacement.

    .venv/bin/python -m bench.operator_load [--source DIR] [--runs 1,10,100] [--minutes M]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _harness as h
from bench import _operator_cluster as oc
from bench._operator_log import Window, count, operator_entries, rows
from testbed.kube.client import KubeApi
from testbed.processes import ManagedProcess

NAME = "operator"
FINISHED_TARGET = 1.0
RUNNING_TARGET = 10.0
POLL_S = 1.0
PROGRESS_S = 15.0


@dataclass
class Options:
    source: Path = h.ROOT
    runs: tuple[int, ...] = (1, 10, 100)
    minutes: float = 2.0
    warmup: float = 20.0
    nodes: int = 2
    mailbox: str = "s3"  # s3 (an empty-bucket stand-in), closed, file
    replace_reps: int = 3
    replace_timeout: float = 200.0
    operator_env: dict[str, str] = field(default_factory=dict)  # added after the defaults


@dataclass
class Measured:
    runs: int
    setup_s: float = math.nan  # runs created -> every run Running
    finish_s: float = math.nan  # pods Succeeded -> every run Succeeded
    running: Window | None = None
    finished: Window | None = None
    start: Window | None = None  # requests per run (seconds=60): created -> running window
    finish: Window | None = None  # pods Succeeded -> finished window
    cpu: dict[str, float] = field(default_factory=dict)  # "<scenario> operator|server" -> %
    s3: dict[str, float] = field(default_factory=dict)  # scenario -> S3 requests/run/min
    error: str | None = None


class Setup:
    """One API server stand-in, S3 stand-in and operator; closed by the ExitStack."""

    def __init__(
        self, stack: ExitStack, opts: Options, workdir: Path, store: str, label: str
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.s3_log: list[Any] = []
        self.endpoint: str | None = None
        if store == "s3":
            self.endpoint, self.s3_log = stack.enter_context(oc.empty_s3())
        elif store == "hang":
            self.endpoint, self.s3_log = stack.enter_context(oc.hanging_s3())
        elif store == "closed":
            from testbed.stub_s3 import closed_port

            self.endpoint = f"http://127.0.0.1:{closed_port()}"
        self.server = oc.LoggingApiServer(logs_dir=workdir / "pod-logs").start()
        stack.callback(self.server.stop)
        self.api = oc.bench_api(self.server.url)
        stack.callback(self.api.close)
        crd = opts.source / "charts/gradientmail-operator/crds/gradientmailruns.yaml"
        oc.install(self.api, crd, self.endpoint)
        self.box = oc.mailbox(self.endpoint, workdir / "mailbox")
        kubeconfig = self.server.write_kubeconfig(workdir / "kubeconfig")
        env = oc.operator_env(opts.source, kubeconfig, workdir) | opts.operator_env
        self.log = workdir / "operator.log"
        h.progress(f"{label}: starting kopf ({opts.source})")
        self.operator: ManagedProcess = oc.start_operator(opts.source, env, self.log)
        stack.callback(self.operator.stop)

    def alive(self) -> None:
        status = self.operator.exit_status()
        if status is not None:
            tail = self.operator.output()[-3000:]
            raise RuntimeError(f"kopf exited with {status}; its log ends:\n{tail}")


def _until(
    what: str, check: Callable[[], bool], timeout: float, setup: Setup, every: float = POLL_S
) -> float:
    """Seconds until ``check()`` holds; raises after ``timeout`` (progress on the way)."""
    start = time.monotonic()
    said = start
    while True:
        setup.alive()
        if check():
            return time.monotonic() - start
        now = time.monotonic()
        if now - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        if now - said >= PROGRESS_S:
            h.progress(f"  waiting for {what} ({now - start:.0f} s)")
            said = now
        time.sleep(every)


def _phases(api: KubeApi) -> dict[str, str]:
    return {r["metadata"]["name"]: (r.get("status") or {}).get("phase", "") for r in oc.runs(api)}


def _mark_pods(api: KubeApi, phase: str, only_pending: bool) -> int:
    """Write ``phase`` into pods' status (only those still Pending, if asked); how many."""
    done = 0
    for pod in oc.pods(api):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        current = (pod.get("status") or {}).get("phase", "Pending")
        if only_pending and current != "Pending":
            continue
        if current != phase:
            oc.set_pod_phase(api, pod, phase)
            done += 1
    return done


def _window(setup: Setup, label: str, seconds: float, runs: int) -> tuple[Window, dict[str, float]]:
    """Count the operator's requests over ``seconds`` from now; CPU shares beside them."""
    h.progress(f"{label}: measuring {seconds:.0f} s")
    pid = setup.operator.pid
    s3_before = len(setup.s3_log)
    cpu0, own0, t0 = oc.cpu_seconds(pid), time.process_time(), time.monotonic()
    end = t0 + seconds
    said = t0
    while (now := time.monotonic()) < end:
        setup.alive()
        if now - said >= PROGRESS_S:
            n = setup.server.count_since(t0)
            h.progress(f"  {label}: {now - t0:.0f}/{seconds:.0f} s, {n} operator requests")
            said = now
        time.sleep(min(POLL_S, end - now))
    t1 = time.monotonic()
    cpu1, own1 = oc.cpu_seconds(pid), time.process_time()
    elapsed = t1 - t0
    window = Window(runs, elapsed, count(operator_entries(setup.server.entries(), t0, t1)))
    extra = {
        "operator": 100 * (cpu1 - cpu0) / elapsed,
        "server": 100 * (own1 - own0) / elapsed,
        "s3": (len(setup.s3_log) - s3_before) / runs / (elapsed / 60),
    }
    return window, extra


def _transition(setup: Setup, t0: float, runs: int) -> Window:
    """The operator's requests per run from ``t0`` until now (a Window of 60 s: its
    per-minute figures are per-run totals)."""
    entries = operator_entries(setup.server.entries(), t0, time.monotonic())
    return Window(runs, 60.0, count(entries))


def _dump(setup: Setup, path: Path) -> None:
    """Every request the stand-in answered: seconds, method, path, watch, User-Agent."""
    with path.open("w") as out:
        for e in setup.server.entries():
            out.write(f"{e.t:.3f}\t{e.method}\t{e.path}\t{int(e.watch)}\t{e.agent}\n")


def measure_scale(opts: Options, n: int, workdir: Path) -> Measured:
    """N runs: Running, a window; Succeeded, a window."""
    result = Measured(n)
    label = f"N={n}"
    with ExitStack() as stack:
        setup = Setup(stack, opts, workdir, opts.mailbox, label)
        names = [f"run-{i:03d}" for i in range(n)]
        t0 = time.monotonic()
        for name in names:
            oc.create_run(setup.api, name, setup.box, opts.nodes)
        h.progress(f"{label}: {n} runs created; waiting for their pods, marking them Running")
        budget = 120.0 + 3.0 * n * opts.nodes

        def all_running() -> bool:
            _mark_pods(setup.api, "Running", only_pending=True)
            phases = _phases(setup.api)
            return len(phases) == n and all(p == "Running" for p in phases.values())

        def stage(
            phase: str, settled: Callable[[], bool], t: float
        ) -> tuple[float, Window, Window]:
            """Wait until every run is in ``phase``; the seconds that took, the requests
            of the transition, and those of a steady window after a warm-up."""
            _until(f"{label}: every run {phase}", settled, budget, setup, every=2.0)
            seconds = time.monotonic() - t
            h.progress(f"{label}: every run {phase} after {seconds:.0f} s; warm-up")
            time.sleep(opts.warmup)
            transition = _transition(setup, t, n)
            word = "running" if phase == "Running" else "finished"
            window, extra = _window(setup, f"{label} {word}", opts.minutes * 60, n)
            result.cpu[f"{word} operator"] = extra["operator"]
            result.cpu[f"{word} server"] = extra["server"]
            result.s3[word] = extra["s3"]
            return seconds, transition, window

        result.setup_s, result.start, result.running = stage("Running", all_running, t0)

        t1 = time.monotonic()
        _mark_pods(setup.api, "Succeeded", only_pending=False)

        def all_succeeded() -> bool:
            phases = _phases(setup.api)
            return all(p == "Succeeded" for p in phases.values())

        result.finish_s, result.finish, result.finished = stage("Succeeded", all_succeeded, t1)
        h.progress(f"{label}: stopping kopf and the API server")
        _dump(setup, workdir / "requests.tsv")
    return result


def _index_pods(api: KubeApi, index: int) -> list[dict[str, Any]]:
    return [
        p
        for p in oc.pods(api)
        if (p["metadata"].get("labels") or {}).get(oc.LABEL_INDEX) == str(index)
        and not p["metadata"].get("deletionTimestamp")
    ]


def measure_replacement(opts: Options, store: str, workdir: Path) -> list[float]:
    """Seconds from a pod marked Failed to its replacement's creation, ``replace_reps``
    times (``inf`` where none came within ``replace_timeout``: the rest is skipped)."""
    label = f"replacement, {'hanging' if store == 'hang' else 'working'} store"
    times: list[float] = []
    with ExitStack() as stack:
        setup = Setup(stack, opts, workdir, store, label)
        oc.create_run(setup.api, "replace", setup.box, 2)

        def pods_up() -> bool:
            _mark_pods(setup.api, "Running", only_pending=True)
            pods = oc.pods(setup.api)
            return len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods)

        _until(f"{label}: 2 pods", pods_up, 120.0, setup, every=0.5)
        time.sleep(opts.warmup)  # the first mailbox polls have begun (and hang, if they do)
        for rep in range(opts.replace_reps):
            (old,) = _index_pods(setup.api, 0)
            uid = old["metadata"]["uid"]
            oc.set_pod_phase(setup.api, old, "Failed")

            def replaced(uid: str = uid) -> bool:
                return any(p["metadata"]["uid"] != uid for p in _index_pods(setup.api, 0))

            try:
                took = _until(
                    f"{label}: replacement {rep + 1}",
                    replaced,
                    opts.replace_timeout,
                    setup,
                    every=0.1,
                )
            except TimeoutError:
                times.append(math.inf)
                h.progress(f"{label}: no replacement within {opts.replace_timeout:.0f} s")
                break
            times.append(took)
            h.progress(f"{label}: replacement {rep + 1} after {took:.1f} s")
            _until(f"{label}: new pod Running", pods_up, 60.0, setup, every=0.2)
            time.sleep(3.0)
    return times


# -- the report ----------------------------------------------------------------------------------


def _pods_note(opts: Options) -> str:
    store = {
        "s3": "an S3 stand-in answering like an empty bucket, credentials in a Secret",
        "closed": "S3 on a loopback port nobody listens on, credentials in a Secret",
        "file": "a file:// mailbox (no Secret)",
    }[opts.mailbox]
    return (
        f"Pods: never started (no kubelet); the benchmark writes their status as a kubelet "
        f"would (Running and ready, then Succeeded). {opts.nodes} pods per run. Mailbox: "
        f"{store}. Window: {opts.minutes:g} min after a {opts.warmup:.0f} s warm-up. Every "
        "request the operator's process made is counted (watches, discovery, CRD scanning "
        "too) and divided by N."
    )


def _fmt_secs(values: list[float]) -> str:
    if not values:
        return "-"
    return ", ".join("timeout" if math.isinf(v) else f"{v:.1f}" for v in values)


def build_report(
    opts: Options,
    results: list[Measured],
    replacement: dict[str, list[float]],
    imports: dict[str, str],
) -> h.Report:
    report = h.Report(
        NAME,
        "Operator load: API-server requests per run per minute (issue 16)",
        "the issue's budgets: ≤ 1 request/min per finished run, ≤ 10/min per running run "
        "beyond pod changes",
    )
    columns = [f"N={r.runs}" for r in results]
    for scenario, target in (("running", RUNNING_TARGET), ("finished", FINISHED_TARGET)):
        windows = [getattr(r, scenario) for r in results]
        table = report.table(
            f"{scenario.capitalize()} runs: requests per run per minute "
            f"(target ≤ {target:g} {'beyond pod changes' if scenario == 'running' else 'in all'})",
            ["resource", "verb", *columns],
            note=_pods_note(opts) if scenario == "running" else "",
        )
        for row in rows(windows):
            table.add(*row)
    table = report.table(
        "Transitions: requests per run (not per minute), from creating the runs until the "
        "running window (every run Running, then the warm-up), and from marking the pods "
        "Succeeded until the finished window",
        ["resource", "verb", *[f"N={r.runs} {w}" for r in results for w in ("start", "finish")]],
    )
    for row in rows([w for r in results for w in (r.start, r.finish)]):
        table.add(*row)
    scale = report.table(
        "Scale: each window",
        [
            "N",
            "runs",
            "to phase (s)",
            "window (s)",
            "operator requests/s",
            "kopf CPU",
            "API stand-in CPU",
            "S3 requests/run/min",
        ],
        note="`to phase`: from creating the runs (or marking the pods Succeeded) until every "
        "run shows that phase. CPU: share of one core, the kopf process and this process "
        "(the API server stand-in's thread).",
    )
    for r in results:
        if r.error:
            scale.add(r.runs, "ERROR", r.error)
            continue
        for scenario in ("running", "finished"):
            window = getattr(r, scenario)
            if window is None:
                continue
            scale.add(
                r.runs,
                scenario,
                f"{r.setup_s if scenario == 'running' else r.finish_s:.0f}",
                f"{window.seconds:.0f}",
                f"{sum(window.counts.values()) / window.seconds:.2f}",
                f"{r.cpu.get(scenario + ' operator', math.nan):.0f}%",
                f"{r.cpu.get(scenario + ' server', math.nan):.0f}%",
                f"{r.s3.get(scenario, math.nan):.1f}" if opts.mailbox == "s3" else "-",
            )
    if replacement:
        table = report.table(
            "Pod replacement: a pod marked Failed until its replacement exists",
            ["store", "seconds (each)", "median"],
            note=f"One run of 2 pods; `timeout`: no replacement within "
            f"{opts.replace_timeout:.0f} s (the remaining repetitions skipped). The hanging "
            "store accepts connections and never answers.",
        )
        for store, values in replacement.items():
            median = _fmt_secs([statistics.median(values)]) if values else "-"
            table.add(store, _fmt_secs(values), median)
    for r in results:
        if r.finished is not None:
            value = r.finished.total()
            report.target(
                f"finished runs, N={r.runs}",
                f"{value:.2f} requests/run/min",
                f"≤ {FINISHED_TARGET:g}",
                value <= FINISHED_TARGET,
            )
        if r.running is not None:
            value = r.running.beyond_pod_changes()
            report.target(
                f"running runs beyond pod changes, N={r.runs}",
                f"{value:.2f} requests/run/min",
                f"≤ {RUNNING_TARGET:g}",
                value <= RUNNING_TARGET,
            )
    if "working" in replacement and "hanging" in replacement:
        work, hang = replacement["working"], replacement["hanging"]
        if work and hang:
            worst_work = max(work)
            worst_hang = max(hang)
            report.target(
                "a hanging store does not delay pod replacement",
                f"worst {worst_hang:.1f} s hanging vs {worst_work:.1f} s working"
                if not math.isinf(worst_hang)
                else f"hanging: none within {opts.replace_timeout:.0f} s; working: "
                f"worst {worst_work:.1f} s",
                "hanging ≤ working + 5 s",
                worst_hang <= worst_work + 5.0,
            )
    report.notes.append(
        f"Operator from {opts.source}: gradientmail {imports.get('gradientmail')}, "
        f"gradientmail_operator {imports.get('gradientmail_operator')}, kopf "
        f"{imports.get('kopf')}; `kopf run --standalone --all-namespaces`, default settings"
        + (f" but {opts.operator_env}" if opts.operator_env else "")
        + "."
    )
    for r in results:
        if r.error:
            report.notes.append(f"N={r.runs}: {r.error}")
    report.data = {
        "options": {k: str(v) for k, v in vars(opts).items()},
        "imports": imports,
        "results": [
            {
                "runs": r.runs,
                "setup_s": r.setup_s,
                "finish_s": r.finish_s,
                "cpu": r.cpu,
                "s3": r.s3,
                "error": r.error,
                **{
                    s: (
                        {
                            "seconds": w.seconds,
                            "counts": {f"{a} {b}": c for (a, b), c in w.counts.items()},
                        }
                        if (w := getattr(r, s)) is not None
                        else None
                    )
                    for s in ("start", "running", "finish", "finished")
                },
            }
            for r in results
        ],
        "replacement": replacement,
    }
    return report


def measure(opts: Options, workdir: Path) -> h.Report:
    started = time.monotonic()
    source = opts.source.resolve()
    opts.source = source
    env = oc.operator_env(source, workdir / "kubeconfig-check", workdir)
    imports = oc.check_imports(source, env)
    h.progress(f"operator: imports from {imports['gradientmail_operator']}")
    results: list[Measured] = []
    for n in opts.runs:
        try:
            results.append(measure_scale(opts, n, workdir / f"n{n}"))
        except (RuntimeError, TimeoutError, OSError) as exc:
            h.progress(f"N={n}: {type(exc).__name__}: {exc}")
            results.append(Measured(n, error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    replacement: dict[str, list[float]] = {}
    if opts.replace_reps > 0:
        for store, label in (("s3", "working"), ("hang", "hanging")):
            try:
                replacement[label] = measure_replacement(opts, store, workdir / f"replace-{store}")
            except (RuntimeError, TimeoutError, OSError) as exc:
                h.progress(f"replacement ({label}): {type(exc).__name__}: {exc}")
                replacement[label] = []
    report = build_report(opts, results, replacement, imports)
    report.seconds = time.monotonic() - started
    return report


def run(ctx: h.Context) -> h.Report:
    """``python -m bench operator``: N = 1, 10 (``--quick``: 1 min windows, no hang test)."""
    overrides = dict(ctx.options.get(NAME, {}))
    opts = Options(
        runs=ctx.pick((1, 10, 100), (1, 10)),
        minutes=ctx.pick(2.0, 1.0),
        replace_reps=ctx.pick(3, 0),
    )
    for key, value in overrides.items():
        setattr(opts, key, value)
    return measure(opts, ctx.workdir / "operator-load")


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, so that every ``finally`` stops what it started."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.operator_load",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "--source", type=Path, default=h.ROOT, help="the checkout whose operator and library run"
    )
    parser.add_argument("--runs", default="1,10,100", help="N runs at once, comma-separated")
    parser.add_argument("--minutes", type=float, default=2.0, help="each measurement window")
    parser.add_argument("--warmup", type=float, default=20.0, help="seconds before a window")
    parser.add_argument("--nodes", type=int, default=2, help="pods per run")
    parser.add_argument("--mailbox", choices=["s3", "closed", "file"], default="s3")
    parser.add_argument(
        "--replace-reps", type=int, default=3, help="pod replacements per store (0: skip)"
    )
    parser.add_argument("--replace-timeout", type=float, default=200.0)
    parser.add_argument(
        "--operator-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the operator (every GRADIENTMAIL_OPERATOR_* is removed otherwise; "
        "e.g. GRADIENTMAIL_OPERATOR_FILE_MAILBOXES=shared for --mailbox file)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--json", type=Path, default=None, help="write the record here too")
    args = parser.parse_args(argv)
    opts = Options(
        source=args.source,
        runs=tuple(int(x) for x in args.runs.split(",") if x.strip()),
        minutes=args.minutes,
        warmup=args.warmup,
        nodes=args.nodes,
        mailbox=args.mailbox,
        replace_reps=args.replace_reps,
        replace_timeout=args.replace_timeout,
        operator_env=dict(item.split("=", 1) for item in args.operator_env if "=" in item),
    )
    info = h.machine()
    print("# gradientmail operator load\n")
    print(f"Machine: {h.describe(info)}\n")
    with _terminate_as_interrupt(), contextlib.ExitStack() as stack:
        if args.keep:
            workdir = Path(tempfile.mkdtemp(prefix="gm-operator-load-"))
            h.progress(f"work directory (kept): {workdir}")
        else:
            workdir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="gm-operator-load-"))
            )
        try:
            report = measure(opts, workdir)
        except KeyboardInterrupt:
            h.progress("interrupted: every process stopped")
            return 130
    print(report.render())
    if args.json is not None:
        record = {"machine": info, "load_average_after": list(os.getloadavg())}
        record["benchmark"] = report.to_json()
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"JSON: {args.json}")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nLoad average at the end: {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
