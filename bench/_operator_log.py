"""The operator benchmark's request log: entries recorded by the API server stand-in, their
(resource, verb) as RBAC names them, and the per-run-per-minute counts of a window.

Pure: no server, no processes; ``tests/bench/test_bench_operator_load.py`` feeds it a canned log.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from testbed.audit import Entry as AuditEntry
from testbed.audit import to_request

BENCH_AGENT = "gradientmail-bench/operator-load"
"""The User-Agent of the benchmark's own requests (creating runs, patching pod status,
reading phases): left out of every count."""

POD_CHANGES = frozenset({("pods", "create"), ("pods", "delete"), ("pods", "deletecollection")})
"""Requests that change pods: the running target counts the rest ("beyond pod changes")."""

OPERATOR_WIDE = frozenset({"(discovery)", "customresourcedefinitions", "namespaces"})
"""Resources whose requests do not depend on the runs (still divided by N in the table)."""


@dataclass(frozen=True)
class Entry:
    """One HTTP request the stand-in answered: when (monotonic s), what, and who asked."""

    t: float
    method: str
    path: str
    watch: bool
    agent: str


def key(entry: Entry) -> tuple[str, str]:
    """``(resource, verb)``: ``("pods", "list")``, ``("gradientmailruns/status", "patch")``,
    ``("(discovery)", "get")`` for non-resource URLs (discovery, /version, OpenAPI)."""
    request = to_request(AuditEntry(entry.method, entry.path, entry.watch, entry.agent))
    if request is None:
        return ("(discovery)", entry.method.lower())
    return (request.resource, request.verb)


def operator_entries(entries: Iterable[Entry], t0: float, t1: float) -> list[Entry]:
    """The requests in ``[t0, t1)`` that the benchmark did not make itself."""
    return [e for e in entries if t0 <= e.t < t1 and e.agent != BENCH_AGENT]


def count(entries: Iterable[Entry]) -> Counter[tuple[str, str]]:
    return Counter(key(e) for e in entries)


@dataclass
class Window:
    """The counts of one measurement window: ``runs`` runs over ``seconds``."""

    runs: int
    seconds: float
    counts: Counter[tuple[str, str]]

    def per_run_min(self, k: tuple[str, str]) -> float:
        return self.counts.get(k, 0) / self.runs / (self.seconds / 60.0)

    def total(self) -> float:
        return sum(self.counts.values()) / self.runs / (self.seconds / 60.0)

    def beyond_pod_changes(self) -> float:
        rest = sum(n for k, n in self.counts.items() if k not in POD_CHANGES)
        return rest / self.runs / (self.seconds / 60.0)

    def per_run_only(self) -> float:
        """Without operator-wide requests (discovery, CRD scanning) and watches."""
        rest = sum(
            n
            for (resource, verb), n in self.counts.items()
            if (resource, verb) not in POD_CHANGES
            and resource not in OPERATOR_WIDE
            and verb != "watch"
        )
        return rest / self.runs / (self.seconds / 60.0)


def rate(value: float) -> str:
    if value != value:  # NaN
        return "-"
    if value == 0:
        return "0"
    if value < 0.1:
        return f"{value:.3f}"
    if value < 10:
        return f"{value:.2f}"
    return f"{value:.1f}"


def rows(windows: Sequence[Window | None]) -> list[list[str]]:
    """Table rows, one per (resource, verb) seen in any window, then the totals: requests
    per run per minute in each window (``-`` where a window is missing)."""
    keys = sorted({k for w in windows if w is not None for k in w.counts})
    out = []
    for resource, verb in keys:
        cells = [rate(w.per_run_min((resource, verb))) if w else "-" for w in windows]
        out.append([resource, verb.upper(), *cells])
    out.append(["**total**", "", *[f"**{rate(w.total())}**" if w else "-" for w in windows]])
    out.append(
        [
            "total beyond pod changes",
            "",
            *[rate(w.beyond_pod_changes()) if w else "-" for w in windows],
        ]
    )
    out.append(
        [
            "… of it per run (no watches, discovery, CRDs)",
            "",
            *[rate(w.per_run_only()) if w else "-" for w in windows],
        ]
    )
    return out
