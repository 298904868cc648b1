"""Prometheus metrics of the operator: each run's progress, and the operator's own work.

Per run (labels ``namespace`` and ``run``), from the status the operator writes
(:func:`observe_run`): rounds committed, newest round, live learners, samples committed and
per second, seconds since the newest commit (and its time), restarts, node pods by state,
sync points, and the phase (``gradientmail_run_phase{phase=…}``: 1 for the current one, 0
for the others, as kube-state-metrics does for pods). A value the status does not have yet
(no commit so far, no rate yet) is left out rather than exported as a stale number.
:func:`forget_run` drops every series of a deleted run.

Operator-wide: reconcile passes and mailbox polls by outcome, and the polls' duration.

Everything lives in :data:`REGISTRY`, not prometheus_client's global default registry (no
process or platform collectors, nothing another library registers). :func:`serve` exposes it
over HTTP on ``GRADIENTMAIL_OPERATOR_METRICS_PORT`` (:func:`port_from_env`; 0 turns it off).
The default port is 8081, not 8080: kopf's liveness endpoint is on 8080 in the chart's
defaults and in the operator image's default command line.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric

ENV_PORT = "GRADIENTMAIL_OPERATOR_METRICS_PORT"
DEFAULT_PORT = 8081

PHASES = ("Pending", "Running", "Succeeded", "Failed", "Invalid")
NODE_STATES = ("desired", "running", "succeeded", "failed")
RUN_LABELS = ("namespace", "run")

_log = logging.getLogger(__name__)

# (metric name, status key, help): one gauge each, left out while the key is unset.
_GAUGES = (
    ("gradientmail_run_rounds_committed", "roundsCommitted", "Rounds committed to the mailbox."),
    ("gradientmail_run_newest_round", "newestRound", "Newest round committed."),
    ("gradientmail_run_live_learners", "liveLearners", "Learners whose heartbeat is recent."),
    ("gradientmail_run_samples", "samples", "Training samples in the committed rounds."),
    (
        "gradientmail_run_samples_per_second",
        "samplesPerSecond",
        "Samples per second over the recent commits.",
    ),
    (
        "gradientmail_run_last_commit_age_seconds",
        "lastCommitAgeSeconds",
        "Seconds since the newest commit, when the mailbox was polled.",
    ),
    ("gradientmail_run_restarts", "restarts", "Failed node pods replaced so far."),
    (
        "gradientmail_run_sync_points_reached",
        "syncPointsReached",
        "Sync points reached, summed over learners.",
    ),
    (
        "gradientmail_run_sync_points_contributed",
        "syncPointsContributed",
        "Sync points at which a learner contributed, summed over learners.",
    ),
    (
        "gradientmail_run_sync_points_skipped",
        "syncPointsSkipped",
        "Sync points a learner skipped, summed over learners.",
    ),
    (
        "gradientmail_run_sync_waited_seconds",
        "waitedSeconds",
        "Seconds learners waited at sync points, summed over learners.",
    ),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


T = TypeVar("T")


@dataclass(frozen=True)
class _Snapshot:
    values: dict[str, float]
    phase: str | None
    nodes: dict[str, float]
    last_commit: float | None  # Unix time of the newest commit


class _PerRun(Generic[T]):
    """The newest value of each run, keyed by (namespace, name); a scrape reads them all
    (a collector's ``collect`` runs on the metrics server's thread, the puts on kopf's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, str], T] = {}

    def put(self, key: tuple[str, str], value: T) -> None:
        with self._lock:
            self._values[key] = value

    def drop(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._values.pop(key, None)

    def items(self) -> list[tuple[tuple[str, str], T]]:
        with self._lock:
            return sorted(self._values.items(), key=lambda item: item[0])


class _RunCollector(_PerRun[_Snapshot]):
    """The per-run gauges, built from the newest snapshot of each run at every scrape."""

    def collect(self) -> Iterator[Metric]:
        runs = self.items()
        for name, key, text in _GAUGES:
            family = GaugeMetricFamily(name, text, labels=RUN_LABELS)
            for labels, snap in runs:
                if key in snap.values:
                    family.add_metric(labels, snap.values[key])
            yield family
        commit = GaugeMetricFamily(
            "gradientmail_run_last_commit_timestamp_seconds",
            "Unix time of the newest commit (the poll's time less its age).",
            labels=RUN_LABELS,
        )
        for labels, snap in runs:
            if snap.last_commit is not None:
                commit.add_metric(labels, snap.last_commit)
        yield commit
        nodes = GaugeMetricFamily(
            "gradientmail_run_nodes",
            "Node pods of the run: desired, and running, succeeded or failed.",
            labels=(*RUN_LABELS, "state"),
        )
        for labels, snap in runs:
            for state, value in snap.nodes.items():
                nodes.add_metric((*labels, state), value)
        yield nodes
        phase = GaugeMetricFamily(
            "gradientmail_run_phase",
            "The run's phase: 1 for the current one, 0 for the others.",
            labels=(*RUN_LABELS, "phase"),
        )
        for labels, snap in runs:
            if snap.phase is None:
                continue
            for name in (*PHASES, *(() if snap.phase in PHASES else (snap.phase,))):
                phase.add_metric((*labels, name), 1.0 if name == snap.phase else 0.0)
        yield phase
        count = GaugeMetricFamily("gradientmail_operator_runs", "Runs the operator follows.")
        count.add_metric((), float(len(runs)))
        yield count


REGISTRY = CollectorRegistry(auto_describe=True)
_RUNS = _RunCollector()
REGISTRY.register(_RUNS)

RECONCILES = Counter(
    "gradientmail_operator_reconciles",
    "Reconcile passes of runs, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
MAILBOX_POLLS = Counter(
    "gradientmail_operator_mailbox_polls",
    "Mailbox polls (status reads from the object store), by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
POLL_SECONDS = Histogram(
    "gradientmail_operator_mailbox_poll_duration_seconds",
    "Duration of a mailbox poll.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
    registry=REGISTRY,
)


class _PollCollector(_PerRun[tuple[str, float, float]]):
    """Each run's newest mailbox poll: (outcome, its duration, when it ended)."""

    def collect(self) -> Iterator[Metric]:
        polls = self.items()
        duration = GaugeMetricFamily(
            "gradientmail_run_last_poll_duration_seconds",
            "Duration of the run's newest mailbox poll, labelled with its outcome.",
            labels=(*RUN_LABELS, "outcome"),
        )
        ended = GaugeMetricFamily(
            "gradientmail_run_last_poll_timestamp_seconds",
            "Unix time the run's newest mailbox poll ended.",
            labels=RUN_LABELS,
        )
        for labels, (outcome, seconds, at) in polls:
            duration.add_metric((*labels, outcome), seconds)
            ended.add_metric(labels, at)
        yield duration
        yield ended


_POLLS = _PollCollector()
REGISTRY.register(_POLLS)


def observe_run(namespace: str, name: str, status: Mapping[str, Any]) -> None:
    """Record the run's status (the whole status, or the operator's view of it: keys as in
    the GradientMailRun status, e.g. ``roundsCommitted``, ``phase``, ``nodes``). Replaces
    what was recorded for the run before: a key now absent or None is left out."""
    values = {key: v for _n, key, _t in _GAUGES if (v := _number(status.get(key))) is not None}
    raw_nodes = status.get("nodes")
    nodes: dict[str, float] = {}
    if isinstance(raw_nodes, Mapping):
        for state in NODE_STATES:
            count = _number(raw_nodes.get(state))
            if count is not None:
                nodes[state] = count
    phase = status.get("phase")
    age = values.get("lastCommitAgeSeconds")
    _RUNS.put(
        (namespace, name),
        _Snapshot(
            values=values,
            phase=str(phase) if phase else None,
            nodes=nodes,
            last_commit=None if age is None else time.time() - age,
        ),
    )


def forget_run(namespace: str, name: str) -> None:
    """Drop every per-run series of a run (deleted, or no longer served)."""
    _RUNS.drop((namespace, name))
    _POLLS.drop((namespace, name))


def reconciled(outcome: str = "ok") -> None:
    """Count one reconcile pass (``ok``, or ``error`` when it raised)."""
    RECONCILES.labels(outcome=outcome).inc()


def poll_done(namespace: str, name: str, outcome: str, seconds: float) -> None:
    """Count one mailbox poll of a run and its duration. ``outcome``: a short fixed word
    (``ok``, ``unreachable``, ``error``, …), never a message: each one is a series."""
    MAILBOX_POLLS.labels(outcome=outcome).inc()
    POLL_SECONDS.observe(seconds)
    _POLLS.put((namespace, name), (outcome, seconds, time.time()))


def port_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The metrics port from ``GRADIENTMAIL_OPERATOR_METRICS_PORT`` (default 8081; 0: off)."""
    env = os.environ if environ is None else environ
    text = env.get(ENV_PORT, "").strip()
    if not text:
        return DEFAULT_PORT
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{ENV_PORT}={text!r}: not a port number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{ENV_PORT}={port}: a port is 0 (off) to 65535")
    return port


@dataclass
class MetricsServer:
    """The HTTP server of :data:`REGISTRY` (``/metrics``, and any other path), in a daemon
    thread."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


_server: MetricsServer | None = None
_server_lock = threading.Lock()


def start(port: int, addr: str = "0.0.0.0") -> MetricsServer:
    """Serve :data:`REGISTRY` on ``addr:port`` (port 0: any free port, see ``.port``)."""
    server, thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return MetricsServer(server, thread)


def serve(port: int, addr: str = "0.0.0.0") -> MetricsServer | None:
    """The operator's metrics endpoint: started once per process (later calls return the
    running one); port 0 turns it off. A port that cannot be bound is logged, not raised:
    the operator works without its metrics."""
    global _server
    if port == 0:
        return None
    with _server_lock:
        if _server is None:
            try:
                _server = start(port, addr)
            except OSError as exc:
                _log.warning("metrics: cannot serve on %s:%d: %s", addr, port, exc)
                return None
            _log.info("metrics: serving on %s:%d", addr, _server.port)
        return _server


def stop() -> None:
    """Stop the server :func:`serve` started, if any (tests; the operator's shutdown)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


def exposition() -> bytes:
    """The text exposition of :data:`REGISTRY`, as a scrape gets it."""
    return generate_latest(REGISTRY)


__all__ = [
    "DEFAULT_PORT",
    "ENV_PORT",
    "REGISTRY",
    "MetricsServer",
    "exposition",
    "forget_run",
    "observe_run",
    "poll_done",
    "port_from_env",
    "reconciled",
    "serve",
    "start",
    "stop",
]
