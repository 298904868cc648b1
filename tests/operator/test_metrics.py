"""The operator's Prometheus metrics: what a scrape shows, forgetting a run, the HTTP server."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gradientmail_operator import metrics

STATUS = {
    "phase": "Running",
    "roundsCommitted": 7,
    "newestRound": 6,
    "liveLearners": 3,
    "samples": 4096,
    "samplesPerSecond": 812.5,
    "lastCommitAgeSeconds": 4.2,
    "restarts": 1,
    "syncPointsReached": 12,
    "syncPointsContributed": 11,
    "syncPointsSkipped": 1,
    "waitedSeconds": 3.5,
    "nodes": {"desired": 3, "running": 3, "succeeded": 0, "failed": 0},
    "conditions": [{"type": "Ready", "status": "True"}],  # not a number: ignored
    "mailbox": "s3://bucket/prefix",
}


@pytest.fixture
def run() -> Iterator[tuple[str, str]]:
    key = ("team-a", "metrics-test")
    yield key
    metrics.forget_run(*key)


def _samples(name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` in a scrape of the registry whose labels include ``labels``."""
    text = generate_latest(metrics.REGISTRY).decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _value(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def test_a_runs_status_appears_in_the_exposition(run: tuple[str, str]) -> None:
    namespace, name = run
    metrics.observe_run(namespace, name, STATUS)
    labels = {"namespace": namespace, "run": name}
    expected = {
        "gradientmail_run_rounds_committed": 7,
        "gradientmail_run_newest_round": 6,
        "gradientmail_run_live_learners": 3,
        "gradientmail_run_samples": 4096,
        "gradientmail_run_samples_per_second": 812.5,
        "gradientmail_run_last_commit_age_seconds": 4.2,
        "gradientmail_run_restarts": 1,
        "gradientmail_run_sync_points_reached": 12,
        "gradientmail_run_sync_points_contributed": 11,
        "gradientmail_run_sync_points_skipped": 1,
        "gradientmail_run_sync_waited_seconds": 3.5,
    }
    for metric, value in expected.items():
        assert _value(metric, **labels) == value, metric
    assert _value("gradientmail_run_nodes", **labels, state="running") == 3
    assert _value("gradientmail_run_nodes", **labels, state="failed") == 0
    phases = _samples("gradientmail_run_phase", **labels)
    assert {dict(k)["phase"]: v for k, v in phases.items()} == {
        "Pending": 0,
        "Running": 1,
        "Succeeded": 0,
        "Failed": 0,
        "Invalid": 0,
    }
    commit = _value("gradientmail_run_last_commit_timestamp_seconds", **labels)
    assert commit is not None
    assert commit > 1_600_000_000
    text = metrics.exposition().decode()
    assert f'gradientmail_run_rounds_committed{{namespace="{namespace}",run="{name}"}} 7.0' in text
    assert "# TYPE gradientmail_run_phase gauge" in text


def test_a_new_status_replaces_the_old_and_unset_values_are_left_out(
    run: tuple[str, str],
) -> None:
    namespace, name = run
    labels = {"namespace": namespace, "run": name}
    metrics.observe_run(namespace, name, STATUS)
    metrics.observe_run(
        namespace,
        name,
        {"phase": "Succeeded", "roundsCommitted": 9, "lastCommitAgeSeconds": None},
    )
    assert _value("gradientmail_run_rounds_committed", **labels) == 9
    assert _value("gradientmail_run_last_commit_age_seconds", **labels) is None
    assert _value("gradientmail_run_last_commit_timestamp_seconds", **labels) is None
    assert _value("gradientmail_run_live_learners", **labels) is None
    assert _value("gradientmail_run_phase", **labels, phase="Succeeded") == 1
    assert _value("gradientmail_run_phase", **labels, phase="Running") == 0
    # A phase this module does not know (a newer operator's) is still shown.
    metrics.observe_run(namespace, name, {"phase": "Paused", "liveLearners": True})
    assert _value("gradientmail_run_phase", **labels, phase="Paused") == 1
    assert _value("gradientmail_run_live_learners", **labels) is None  # a bool is no count


def test_forget_removes_every_series_of_the_run(run: tuple[str, str]) -> None:
    namespace, name = run
    other = ("team-b", "stays")
    metrics.observe_run(namespace, name, STATUS)
    metrics.observe_run(*other, STATUS)
    metrics.poll_done(namespace, name, "ok", 0.3)
    runs = _value("gradientmail_operator_runs")
    assert _samples("gradientmail_run_phase", namespace=namespace, run=name)
    try:
        metrics.forget_run(namespace, name)
        text = metrics.exposition().decode()
        assert f'run="{name}"' not in text
        assert _value("gradientmail_operator_runs") == (runs or 0) - 1
        assert _value("gradientmail_run_rounds_committed", namespace="team-b", run="stays") == 7
        metrics.forget_run(namespace, name)  # twice: harmless
    finally:
        metrics.forget_run(*other)


def test_reconciles_and_polls_are_counted(run: tuple[str, str]) -> None:
    namespace, name = run
    before_ok = _value("gradientmail_operator_reconciles_total", outcome="ok") or 0
    before_polls = _value("gradientmail_operator_mailbox_polls_total", outcome="unreachable") or 0
    before_count = _value("gradientmail_operator_mailbox_poll_duration_seconds_count") or 0
    metrics.reconciled()
    metrics.reconciled("error")
    metrics.poll_done(namespace, name, "unreachable", 2.0)
    metrics.poll_done(namespace, name, "ok", 0.04)
    assert _value("gradientmail_operator_reconciles_total", outcome="ok") == before_ok + 1
    assert (_value("gradientmail_operator_reconciles_total", outcome="error") or 0) >= 1
    assert (
        _value("gradientmail_operator_mailbox_polls_total", outcome="unreachable")
        == before_polls + 1
    )
    assert _value("gradientmail_operator_mailbox_poll_duration_seconds_count") == before_count + 2
    assert (
        _value("gradientmail_operator_mailbox_poll_duration_seconds_bucket", le="0.05") or 0
    ) >= 1
    labels = {"namespace": namespace, "run": name}
    # Only the newest poll of the run, with its outcome.
    assert _value("gradientmail_run_last_poll_duration_seconds", **labels, outcome="ok") == 0.04
    assert (
        _value("gradientmail_run_last_poll_duration_seconds", **labels, outcome="unreachable")
        is None
    )


def test_the_registry_is_not_the_global_default() -> None:
    assert metrics.REGISTRY is not DEFAULT_REGISTRY
    assert DEFAULT_REGISTRY.get_sample_value("gradientmail_operator_runs") is None
    text = metrics.exposition().decode()
    assert "process_cpu_seconds_total" not in text
    assert "python_info" not in text


@pytest.mark.parametrize(
    ("env", "port"),
    [({}, metrics.DEFAULT_PORT), ({metrics.ENV_PORT: "9102"}, 9102), ({metrics.ENV_PORT: "0"}, 0)],
)
def test_the_port_comes_from_the_environment(env: dict[str, str], port: int) -> None:
    assert metrics.port_from_env(env) == port


@pytest.mark.parametrize("text", ["http", "-1", "65536"])
def test_a_bad_port_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=metrics.ENV_PORT):
        metrics.port_from_env({metrics.ENV_PORT: text})


def _get(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def test_an_ephemeral_server_answers_http(run: tuple[str, str]) -> None:
    namespace, name = run
    metrics.observe_run(namespace, name, STATUS)
    server = metrics.start(0, "127.0.0.1")
    try:
        assert server.port > 0
        status, content_type, body = _get(server.port)
        assert status == 200
        assert content_type.startswith("text/plain")
        assert f'gradientmail_run_live_learners{{namespace="{namespace}",run="{name}"}} 3.0' in body
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_starts_once_and_port_zero_is_off(run: tuple[str, str]) -> None:
    metrics.stop()  # one an in-process operator of another test may have left
    assert metrics.serve(0) is None
    port = _free_port()
    server = metrics.serve(port, "127.0.0.1")
    try:
        assert server is not None
        assert server.port == port
        assert metrics.serve(port, "127.0.0.1") is server  # a second call: the same server
        status, _, body = _get(port)
        assert status == 200
        assert "gradientmail_operator_runs" in body
    finally:
        metrics.stop()
    with pytest.raises(urllib.error.URLError, match="refused"):
        _get(port)


def test_a_busy_port_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    metrics.stop()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = int(sock.getsockname()[1])
        assert metrics.serve(port, "127.0.0.1") is None
    assert f"cannot serve on 127.0.0.1:{port}" in caplog.text
