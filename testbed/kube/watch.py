"""Watch streams: JSON lines of ``{"type": ..., "object": ...}``, one per change.

A watch without ``resourceVersion`` (or with "0") first sends the current objects as ADDED;
with a version it replays the retained history after that version (an ``ERROR`` event with
code 410 when part of it was already dropped), then follows live changes. The snapshot or
replay and the live subscription are taken in one step on the server's loop, so no change
between a list and a watch from the list's version can be lost.

Selectors apply to each change as the real server applies them: an object that starts to
match is ADDED, one that stops matching is DELETED. ``allowWatchBookmarks`` adds a BOOKMARK
every ``bookmark_interval_s``; ``sendInitialEvents`` ends the initial ADDED events with a
bookmark annotated ``k8s.io/initial-events-end``. ``timeoutSeconds`` closes the stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from testbed.kube.errors import ApiError
from testbed.kube.resources import ResourceType
from testbed.kube.selectors import FieldSelector, LabelSelector
from testbed.kube.store import Store, WatchEvent
from testbed.kube.tables import render_table

__all__ = ["WatchRequest", "serve_watch"]

Obj = dict[str, Any]

MAX_QUEUED_EVENTS = 10_000
"""A watcher this far behind is disconnected (it reconnects with its last version)."""
_LIVENESS_CHECK_S = 1.0


@dataclass(frozen=True)
class WatchRequest:
    rt: ResourceType
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    resource_version: str | None
    timeout_s: float
    bookmarks: bool
    send_initial_events: bool
    table_version: str | None
    include_object: str

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, event: WatchEvent) -> tuple[str, Obj] | None:
        """What this watcher sees of ``event``, if anything."""
        if event.key != self.rt.storage_key:
            return None
        now, before = self.matches(event.obj), self.matches(event.old)
        if event.type == "DELETED":
            return ("DELETED", event.obj) if now or before else None
        if now and before:
            return ("MODIFIED", event.obj)
        if now:
            return ("ADDED", event.obj)
        if before:
            return ("DELETED", event.obj)
        return None


class _Closing:
    """Sentinel queued to end a stream: server shutdown or a watcher that fell behind."""


CLOSE = _Closing()


def _encode(request: WatchRequest, kind: str, obj: Obj) -> bytes:
    if obj.get("apiVersion") != request.rt.api_version and kind != "BOOKMARK":
        obj = {**obj, "apiVersion": request.rt.api_version}
    if request.table_version and kind != "BOOKMARK":
        meta = obj.get("metadata") or {}
        obj = render_table(
            request.rt,
            [obj],
            resource_version=str(meta.get("resourceVersion", "")),
            include_object=request.include_object,
            table_version=request.table_version,
        )
    return (json.dumps({"type": kind, "object": obj}, separators=(",", ":")) + "\n").encode()


def _bookmark(request: WatchRequest, rv: int, *, initial_end: bool = False) -> bytes:
    metadata: Obj = {"resourceVersion": str(rv)}
    if initial_end:
        metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
    obj = {"kind": request.rt.kind, "apiVersion": request.rt.api_version, "metadata": metadata}
    return _encode(request, "BOOKMARK", obj)


async def serve_watch(
    http_request: web.Request,
    store: Store,
    request: WatchRequest,
    *,
    bookmark_interval_s: float,
    register: Callable[[asyncio.Queue[WatchEvent | _Closing]], Callable[[], None]],
) -> web.StreamResponse:
    """Stream ``request``'s events until its timeout, a disconnect or server shutdown."""
    queue: asyncio.Queue[WatchEvent | _Closing] = asyncio.Queue()

    def deliver(event: WatchEvent) -> None:
        if queue.qsize() >= MAX_QUEUED_EVENTS:
            queue.put_nowait(CLOSE)
        else:
            queue.put_nowait(event)

    # Snapshot (or replay) and subscription in one synchronous step: nothing falls between.
    first: list[bytes] = []
    unsubscribe = store.subscribe(deliver)
    unregister = register(queue)
    try:
        version = request.resource_version
        if version in (None, "", "0") or request.send_initial_events:
            items, rv, _ = store.list_objects(
                request.rt, request.namespace, request.labels, request.fields
            )
            first = [_encode(request, "ADDED", obj) for obj in items]
            if request.send_initial_events and request.bookmarks:
                first.append(_bookmark(request, rv, initial_end=True))
        else:
            try:
                since = int(str(version))
            except ValueError as exc:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {version!r}") from exc
            events = store.events_since(since)
            if events is None:
                gone = ApiError(
                    410, "Expired", f"too old resource version: {since} ({store.resource_version})"
                )
                first = [(json.dumps({"type": "ERROR", "object": gone.status()}) + "\n").encode()]
                queue.put_nowait(CLOSE)
            else:
                for event in events:
                    seen = request.translate(event)
                    if seen is not None:
                        first.append(_encode(request, *seen))
    except BaseException:
        unsubscribe()
        unregister()
        raise

    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    loop = asyncio.get_running_loop()
    try:
        await response.prepare(http_request)
        for line in first:
            await response.write(line)
        deadline = loop.time() + request.timeout_s
        next_bookmark = loop.time() + bookmark_interval_s
        while True:
            now = loop.time()
            if now >= deadline:
                break
            transport = http_request.transport
            if transport is None or transport.is_closing():
                break  # the client went away
            wait = min(deadline - now, _LIVENESS_CHECK_S)
            if request.bookmarks:
                wait = min(wait, max(0.0, next_bookmark - now))
            try:
                item = await asyncio.wait_for(queue.get(), timeout=wait)
            except TimeoutError:
                if request.bookmarks and loop.time() >= next_bookmark:
                    await response.write(_bookmark(request, store.resource_version))
                    next_bookmark = loop.time() + bookmark_interval_s
                continue
            if isinstance(item, _Closing):
                break
            seen = request.translate(item)
            if seen is not None:
                await response.write(_encode(request, *seen))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away mid-write
    finally:
        unsubscribe()
        unregister()
    return response
