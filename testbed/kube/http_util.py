"""Small HTTP helpers shared by the API server's handlers."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from testbed.kube.errors import bad_request

__all__ = ["flag", "int_param", "json_response", "negotiated"]


def json_response(body: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
    )


def flag(value: str | None) -> bool:
    return (value or "").lower() in ("true", "1", "yes")


def int_param(query: Any, name: str) -> int | None:
    value = query.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise bad_request(f"invalid {name}: {value!r}") from exc


def negotiated(request: web.Request) -> tuple[str | None, str | None]:
    """(``as`` kind, its version) of the first acceptable meta.k8s.io rendering, if any."""
    for part in request.headers.get("Accept", "").split(","):
        media, *raw = (p.strip() for p in part.split(";"))
        params = dict(p.split("=", 1) for p in raw if "=" in p)
        if media not in ("application/json", "*/*", "application/*"):
            continue
        if "as" not in params:
            return None, None
        if params.get("g") == "meta.k8s.io" and params["as"] in (
            "Table",
            "PartialObjectMetadata",
            "PartialObjectMetadataList",
        ):
            return params["as"], params.get("v", "v1")
    return None, None
