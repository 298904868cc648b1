"""The operator benchmark's counting and table, on a canned request log (no cluster)."""

from __future__ import annotations

from bench._operator_log import BENCH_AGENT, Entry, Window, count, key, operator_entries, rows

KOPF = "kopf/1.45.2"
CLIENT = "OpenAPI-Generator/31.0.0/python"
RUNS = "/apis/gradientmail.dev/v1alpha1/namespaces/default/gradientmailruns"


def test_requests_are_named_by_resource_and_verb() -> None:
    assert key(Entry(0, "GET", "/api/v1/namespaces/default/pods", False, CLIENT)) == (
        "pods",
        "list",
    )
    assert key(Entry(0, "GET", "/api/v1/namespaces/default/secrets/s", False, CLIENT)) == (
        "secrets",
        "get",
    )
    assert key(Entry(0, "PATCH", f"{RUNS}/r/status", False, KOPF)) == (
        "gradientmailruns/status",
        "patch",
    )
    assert key(Entry(0, "GET", "/apis/gradientmail.dev/v1alpha1/gradientmailruns", True, KOPF)) == (
        "gradientmailruns",
        "watch",
    )
    assert key(Entry(0, "POST", "/api/v1/namespaces/default/events", False, KOPF)) == (
        "events",
        "create",
    )
    assert key(Entry(0, "GET", "/apis", False, KOPF)) == ("(discovery)", "get")


def test_a_window_counts_the_operator_per_run_per_minute() -> None:
    log = [
        Entry(0.5, "GET", "/api/v1/namespaces/default/pods", False, CLIENT),  # before
        *[Entry(1 + i, "GET", "/api/v1/namespaces/default/pods", False, CLIENT) for i in range(60)],
        *[Entry(1 + i, "PATCH", f"{RUNS}/r{i % 2}/status", False, KOPF) for i in range(30)],
        Entry(2, "POST", "/api/v1/namespaces/default/pods", False, CLIENT),
        Entry(3, "GET", "/apis/gradientmail.dev/v1alpha1/gradientmailruns", True, KOPF),
        Entry(4, "PATCH", "/api/v1/namespaces/default/pods/p/status", False, BENCH_AGENT),
        Entry(121, "GET", "/api/v1/namespaces/default/pods", False, CLIENT),  # after
    ]
    window = Window(runs=2, seconds=120.0, counts=count(operator_entries(log, 1.0, 121.0)))
    assert window.counts[("pods", "list")] == 60
    assert ("pods/status", "patch") not in window.counts  # the benchmark's own
    assert window.per_run_min(("pods", "list")) == 15.0
    assert window.per_run_min(("gradientmailruns/status", "patch")) == 7.5
    assert window.total() == (60 + 30 + 1 + 1) / 2 / 2
    assert window.beyond_pod_changes() == (60 + 30 + 1) / 2 / 2
    assert window.per_run_only() == (60 + 30) / 2 / 2
    table = rows([window, None])
    assert table[0] == ["gradientmailruns", "WATCH", "0.25", "-"]
    assert ["pods", "LIST", "15.0", "-"] in table
    assert table[-3][:3] == ["**total**", "", "**23.0**"]
    assert table[-2][2] == "22.8"
