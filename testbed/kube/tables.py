"""Server-side printing: ``meta.k8s.io`` Tables, as ``kubectl get`` asks for them.

A custom resource is printed with a Name column and its CRD's ``additionalPrinterColumns``
(each evaluated with :func:`jsonpath`; ``date`` columns become ages like ``5m``), or Name and
Age when the CRD declares none. Built-in types get the columns the real server prints for the
common ones (pods, namespaces, nodes, config maps, secrets, events, services, deployments,
CRDs, leases) and Name/Age otherwise.

:func:`jsonpath` evaluates the subset of Kubernetes JSONPath printer columns use: ``.a.b``,
``['a.b']``, ``[0]``, ``[*]`` and filters ``[?(@.type=="Ready")]`` (``==``/``!=``), with or
without surrounding ``{}``.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from typing import Any

from testbed.kube.resources import ResourceType

__all__ = ["JsonPathError", "human_age", "jsonpath", "render_table"]

Obj = dict[str, Any]


class JsonPathError(ValueError):
    """A JSONPath expression outside the supported subset."""


_TOKEN_RE = re.compile(
    r"""\.(?P<field>[A-Za-z0-9_$-]+)
      | \[\s*'(?P<quoted>[^']*)'\s*\]
      | \[\s*"(?P<dquoted>[^"]*)"\s*\]
      | \[\s*(?P<index>-?\d+)\s*\]
      | \[\s*(?P<star>\*)\s*\]
      | \[\s*\?\(\s*@(?P<fpath>(?:\.[A-Za-z0-9_-]+)+)\s*(?P<op>==|!=)\s*
            (?:'(?P<fsq>[^']*)'|"(?P<fdq>[^"]*)"|(?P<fnum>[-\w.]+))\s*\)\s*\]
    """,
    re.VERBOSE,
)


def _tokens(path: str) -> list[tuple[str, Any]]:
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    if text.startswith("$"):
        text = text[1:]
    if text and not text.startswith((".", "[")):
        text = "." + text
    tokens: list[tuple[str, Any]] = []
    position = 0
    while position < len(text):
        match = _TOKEN_RE.match(text, position)
        if match is None:
            raise JsonPathError(f"unsupported JSONPath {path!r} at {text[position:]!r}")
        groups = match.groupdict()
        if groups["field"] is not None:
            tokens.append(("field", groups["field"]))
        elif groups["quoted"] is not None or groups["dquoted"] is not None:
            tokens.append(
                ("field", groups["quoted"] if groups["quoted"] is not None else groups["dquoted"])
            )
        elif groups["index"] is not None:
            tokens.append(("index", int(groups["index"])))
        elif groups["star"] is not None:
            tokens.append(("star", None))
        else:
            expected = next(
                g for g in (groups["fsq"], groups["fdq"], groups["fnum"]) if g is not None
            )
            tokens.append(("filter", (groups["fpath"][1:].split("."), groups["op"], expected)))
        position = match.end()
    return tokens


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def jsonpath(obj: Any, path: str) -> list[Any]:
    """All values ``path`` selects in ``obj`` (empty when nothing matches)."""
    nodes = [obj]
    for kind, arg in _tokens(path):
        found: list[Any] = []
        for node in nodes:
            if kind == "field":
                if isinstance(node, dict) and arg in node:
                    found.append(node[arg])
            elif kind == "index":
                if isinstance(node, list) and -len(node) <= arg < len(node):
                    found.append(node[arg])
            elif kind == "star":
                if isinstance(node, list):
                    found.extend(node)
                elif isinstance(node, dict):
                    found.extend(node.values())
            elif isinstance(node, list):
                field_path, op, expected = arg
                for item in node:
                    value: Any = item
                    for segment in field_path:
                        value = value.get(segment) if isinstance(value, dict) else None
                    equal = value is not None and _scalar(value) == expected
                    if equal == (op == "=="):
                        found.append(item)
        nodes = found
    return nodes


def human_age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    """``kubectl``'s age format (``duration.HumanDuration``): 45s, 3m20s, 5h, 2d3h, 1y."""
    if not timestamp:
        return "<unknown>"
    try:
        moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    now = now or datetime.datetime.now(datetime.UTC)
    seconds = int((now - moment).total_seconds())
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def _column(
    name: str, kind: str = "string", description: str = "", *, priority: int = 0, fmt: str = ""
) -> Obj:
    return {
        "name": name,
        "type": kind,
        "format": fmt,
        "description": description,
        "priority": priority,
    }


NAME_COLUMN = _column("Name", fmt="name", description="Name must be unique within a namespace.")
AGE_COLUMN = _column(
    "Age",
    description="CreationTimestamp is a timestamp representing the server time when this "
    "object was created.",
)


def _meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def _age(obj: Obj) -> str:
    return human_age(_meta(obj).get("creationTimestamp"))


def _pod_status(pod: Obj) -> str:
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Pending"
    running = False
    for cs in reversed(status.get("containerStatuses") or []):
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state:
            terminated = state["terminated"] or {}
            if terminated.get("reason"):
                reason = terminated["reason"]
            elif terminated.get("signal"):
                reason = f"Signal:{terminated['signal']}"
            else:
                reason = f"ExitCode:{terminated.get('exitCode', 0)}"
        elif "running" in state and cs.get("ready"):
            running = True
    if reason == "Completed" and running:
        reason = "Running"
    if _meta(pod).get("deletionTimestamp"):
        reason = "Terminating"
    return str(reason)


def _pod_row(pod: Obj) -> list[Any]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for cs in statuses if cs.get("ready"))
    restarts = sum(int(cs.get("restartCount", 0)) for cs in statuses)
    return [
        _meta(pod).get("name"),
        f"{ready}/{len(spec.get('containers') or [])}",
        _pod_status(pod),
        str(restarts),
        _age(pod),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        "<none>",
        "<none>",
    ]


def _node_ready(node: Obj) -> str:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return "Ready" if condition.get("status") == "True" else "NotReady"
    return "Unknown"


def _event_object(event: Obj) -> str:
    involved = event.get("involvedObject") or event.get("regarding") or {}
    return f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"


def _event_last_seen(event: Obj) -> str:
    return human_age(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or _meta(event).get("creationTimestamp")
    )


Renderer = tuple[list[Obj], Callable[[Obj], list[Any]]]

_BUILTIN: dict[tuple[str, str], Renderer] = {
    ("", "pods"): (
        [
            NAME_COLUMN,
            _column(
                "Ready",
                description="The aggregate readiness state of this pod for accepting traffic.",
            ),
            _column("Status", description="The aggregate status of the containers in this pod."),
            _column(
                "Restarts",
                description="The number of times the containers in this pod have been restarted.",
            ),
            AGE_COLUMN,
            _column("IP", priority=1, description="IP address allocated to the pod."),
            _column("Node", priority=1, description="Name of the node the pod is assigned to."),
            _column("Nominated Node", priority=1),
            _column("Readiness Gates", priority=1),
        ],
        _pod_row,
    ),
    ("", "namespaces"): (
        [NAME_COLUMN, _column("Status"), AGE_COLUMN],
        lambda o: [_meta(o).get("name"), (o.get("status") or {}).get("phase", ""), _age(o)],
    ),
    ("", "nodes"): (
        [NAME_COLUMN, _column("Status"), _column("Roles"), AGE_COLUMN, _column("Version")],
        lambda o: [
            _meta(o).get("name"),
            _node_ready(o),
            "<none>",
            _age(o),
            ((o.get("status") or {}).get("nodeInfo") or {}).get("kubeletVersion", ""),
        ],
    ),
    ("", "configmaps"): (
        [NAME_COLUMN, _column("Data", "integer"), AGE_COLUMN],
        lambda o: [
            _meta(o).get("name"),
            len(o.get("data") or {}) + len(o.get("binaryData") or {}),
            _age(o),
        ],
    ),
    ("", "secrets"): (
        [NAME_COLUMN, _column("Type"), _column("Data", "integer"), AGE_COLUMN],
        lambda o: [
            _meta(o).get("name"),
            o.get("type", "Opaque"),
            len(o.get("data") or {}),
            _age(o),
        ],
    ),
    ("", "events"): (
        [
            _column("Last Seen"),
            _column("Type"),
            _column("Reason"),
            _column("Object"),
            _column("Message"),
            _column("Name", fmt="name", priority=1),
        ],
        lambda o: [
            _event_last_seen(o),
            o.get("type", ""),
            o.get("reason", ""),
            _event_object(o),
            o.get("message", o.get("note", "")),
            _meta(o).get("name"),
        ],
    ),
    ("", "services"): (
        [
            NAME_COLUMN,
            _column("Type"),
            _column("Cluster-IP"),
            _column("External-IP"),
            _column("Port(s)"),
            AGE_COLUMN,
        ],
        lambda o: [
            _meta(o).get("name"),
            (o.get("spec") or {}).get("type", "ClusterIP"),
            (o.get("spec") or {}).get("clusterIP", "<none>"),
            "<none>",
            ",".join(
                f"{p.get('port')}/{p.get('protocol', 'TCP')}"
                for p in (o.get("spec") or {}).get("ports") or []
            )
            or "<none>",
            _age(o),
        ],
    ),
    ("apps", "deployments"): (
        [
            NAME_COLUMN,
            _column("Ready"),
            _column("Up-to-date", "integer"),
            _column("Available", "integer"),
            AGE_COLUMN,
        ],
        lambda o: [
            _meta(o).get("name"),
            f"{(o.get('status') or {}).get('readyReplicas', 0)}"
            f"/{(o.get('spec') or {}).get('replicas', 1)}",
            (o.get("status") or {}).get("updatedReplicas", 0),
            (o.get("status") or {}).get("availableReplicas", 0),
            _age(o),
        ],
    ),
    ("apiextensions.k8s.io", "customresourcedefinitions"): (
        [NAME_COLUMN, _column("Created At", "date")],
        lambda o: [_meta(o).get("name"), _meta(o).get("creationTimestamp")],
    ),
    ("coordination.k8s.io", "leases"): (
        [NAME_COLUMN, _column("Holder"), AGE_COLUMN],
        lambda o: [_meta(o).get("name"), (o.get("spec") or {}).get("holderIdentity", ""), _age(o)],
    ),
}


def _cell(value_list: list[Any], kind: str) -> Any:
    if not value_list:
        return None
    if len(value_list) > 1:
        return ",".join(v if isinstance(v, str) else json.dumps(v) for v in value_list)
    value = value_list[0]
    if value is None:
        return None
    if kind == "date":
        return human_age(str(value))
    if kind == "integer" and isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    if kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return value
    if kind == "boolean" and isinstance(value, bool):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return _scalar(value)


def _columns_and_row(rt: ResourceType) -> Renderer:
    if rt.columns is not None:
        columns = [NAME_COLUMN] + [
            _column(c.name, c.type, c.description, priority=c.priority, fmt=c.format)
            for c in rt.columns
        ]
        specs = rt.columns

        def row(obj: Obj) -> list[Any]:
            cells: list[Any] = [_meta(obj).get("name")]
            for c in specs:
                try:
                    cells.append(_cell(jsonpath(obj, c.json_path), c.type))
                except JsonPathError:
                    cells.append(None)
            return cells

        return columns, row
    return _BUILTIN.get(
        rt.storage_key, ([NAME_COLUMN, AGE_COLUMN], lambda o: [_meta(o).get("name"), _age(o)])
    )


def render_table(
    rt: ResourceType,
    objects: list[Obj],
    *,
    resource_version: str,
    include_object: str = "Metadata",
    table_version: str = "v1",
    continue_token: str = "",
    with_columns: bool = True,
) -> Obj:
    """A ``meta.k8s.io`` Table of ``objects`` (``include_object``: None, Metadata, Object)."""
    columns, row = _columns_and_row(rt)
    rows = []
    for obj in objects:
        entry: Obj = {"cells": row(obj)}
        if include_object == "Object":
            entry["object"] = obj
        elif include_object != "None":
            entry["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": f"meta.k8s.io/{table_version}",
                "metadata": _meta(obj),
            }
        rows.append(entry)
    metadata: Obj = {"resourceVersion": resource_version}
    if continue_token:
        metadata["continue"] = continue_token
    table: Obj = {
        "kind": "Table",
        "apiVersion": f"meta.k8s.io/{table_version}",
        "metadata": metadata,
        "columnDefinitions": columns if with_columns else [],
        "rows": rows,
    }
    return table
