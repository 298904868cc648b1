"""An API server stand-in that records every request, and the RBAC view of each.

The stand-in enforces no RBAC (``testbed/kube/__init__.py``), so the chart's Roles are checked
against what the operator actually asked for: every request whose User-Agent is kopf's
(``kopf/…``) or the kubernetes client's (``OpenAPI-Generator/…``, ``kube.py``) is turned into
a :class:`~testbed.rbac.Request` and must be allowed by the installed Roles.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from aiohttp import web

from testbed.kube.apiserver import ApiServer
from testbed.rbac import Request

OPERATOR_AGENTS = ("kopf/", "OpenAPI-Generator/")


@dataclass(frozen=True)
class Entry:
    method: str
    path: str
    watch: bool
    agent: str


class AuditingApiServer(ApiServer):
    """:class:`ApiServer` that keeps a log of (method, path, watch, User-Agent)."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self._audit: list[Entry] = []
        self._audit_lock = threading.Lock()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch", "").lower() in ("1", "true")
        entry = Entry(request.method, request.path, watch, request.headers.get("User-Agent", ""))
        with self._audit_lock:
            self._audit.append(entry)
        return await super()._handle(request)

    def entries(self) -> list[Entry]:
        with self._audit_lock:
            return list(self._audit)

    def operator_requests(self) -> set[Request]:
        """The resource requests the operator made (discovery and other non-resource URLs,
        which every authenticated user may read, left out)."""
        found = set()
        for entry in self.entries():
            if entry.agent.startswith(OPERATOR_AGENTS):
                request = to_request(entry)
                if request is not None:
                    found.add(request)
        return found


_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


def to_request(entry: Entry) -> Request | None:
    """The RBAC request of an HTTP request, or None for a non-resource URL (discovery)."""
    segments = [s for s in entry.path.split("/") if s]
    if not segments:
        return None
    if segments[0] == "api" and len(segments) >= 3:
        group, rest = "", segments[2:]
    elif segments[0] == "apis" and len(segments) >= 4:
        group, rest = segments[1], segments[3:]
    else:
        return None  # /api, /apis, /apis/<group>[/<version>], /version, /openapi, /healthz
    namespace = None
    if (
        rest[0] == "namespaces"
        and len(rest) >= 3
        and not (group == "" and len(rest) == 3 and rest[2] in ("status", "finalize"))
    ):
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] if len(rest) < 3 else f"{rest[0]}/{rest[2]}"
    named = len(rest) >= 2
    if entry.method == "GET":
        verb = "get" if named else ("watch" if entry.watch else "list")
    elif entry.method == "DELETE":
        verb = "delete" if named else "deletecollection"
    else:
        verb = _VERBS.get(entry.method, entry.method.lower())
    return Request(verb, group, resource, namespace)
