"""The emulated Kubernetes API server: HTTP on loopback over :class:`~testbed.kube.store.Store`.

Serves what kopf, kubectl, helm and the kubernetes Python client use: discovery (``/api``,
``/api/v1``, ``/apis``, ``/apis/{group}``, ``/apis/{group}/{version}``, ``/version``; no
aggregated discovery, so kubectl falls back to the legacy documents), skeleton OpenAPI
documents (``discovery.py``: no schemas, so clients leave validation to the server, which does
none), and for every type GET/list/watch, POST, PUT, PATCH, DELETE and deletecollection,
the ``status`` subresource, ``pods/log`` (read from the kubelet's log files) and
``pods/binding``. JSON or YAML bodies, and protobuf for the few kinds typed clients send
(``protobuf.py``; other protobuf bodies get 415). ``Accept`` asking for
``as=Table;g=meta.k8s.io`` gets a server-side Table (``tables.py``), also in watches.
Errors are ``Status`` objects with the real codes and reasons.

Use it from a test (it serves from a thread of its own)::

    with ApiServer(logs_dir=tmp_path / "logs") as server:
        server.write_kubeconfig(tmp_path / "kubeconfig")
        requests.get(f"{server.url}/api/v1/namespaces").json()

or inside a running event loop with ``await server.astart()`` / ``await server.astop()``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from testbed.kube import protobuf
from testbed.kube.discovery import (
    group_list,
    openapi_v3_document,
    openapi_v3_root,
    resource_list,
    version_info,
)
from testbed.kube.errors import ApiError, bad_request
from testbed.kube.http_util import flag, int_param, json_response, negotiated
from testbed.kube.logs import serve_pod_log
from testbed.kube.protobuf import ProtobufUnsupported
from testbed.kube.resources import ResourceType
from testbed.kube.selectors import FieldSelector, LabelSelector, SelectorError
from testbed.kube.store import Store, WatchEvent
from testbed.kube.tables import render_table
from testbed.kube.watch import CLOSE, WatchRequest, _Closing, serve_watch
from testbed.loop_thread import LoopThread

__all__ = ["ApiServer", "write_kubeconfig"]

Obj = dict[str, Any]
T = TypeVar("T")
_log = logging.getLogger(__name__)
OPENAPI_V2_PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"

DEFAULT_WATCH_TIMEOUT_S = 1800.0
"""Watches without ``timeoutSeconds`` end after this long (the real server: 30-60 min)."""
START_TIMEOUT_S = 10.0


def write_kubeconfig(path: Path, server_url: str, *, namespace: str = "default") -> Path:
    """A kubeconfig with one context, ``gradientmail-emulator``, for ``server_url``."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "gradientmail-emulator", "cluster": {"server": server_url}}],
        "users": [{"name": "gradientmail-emulator", "user": {"token": "emulator"}}],
        "contexts": [
            {
                "name": "gradientmail-emulator",
                "context": {
                    "cluster": "gradientmail-emulator",
                    "user": "gradientmail-emulator",
                    "namespace": namespace,
                },
            }
        ],
        "current-context": "gradientmail-emulator",
        "preferences": {},
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class ApiServer:
    """The emulator: an aiohttp app on ``host``:``port`` (0: a free port) over one Store.

    ``logs_dir`` is where the kubelet writes container logs (``pods/log`` reads them).
    ``bookmark_interval_s`` spaces watch bookmarks; ``history_size`` bounds the events a
    watch can resume from.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        logs_dir: Path | None = None,
        bookmark_interval_s: float = 5.0,
        history_size: int = 10_000,
    ) -> None:
        self.host = host
        self.port = port
        self.logs_dir = Path(logs_dir) if logs_dir is not None else None
        self.bookmark_interval_s = bookmark_interval_s
        self._history_size = history_size
        self._store: Store | None = None
        self._runner: web.AppRunner | None = None
        self._watch_queues: set[asyncio.Queue[WatchEvent | _Closing]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner_thread = LoopThread("API server", self.astart, self.astop)

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def store(self) -> Store:
        """The state; touch it only on the server's loop (see :meth:`call`)."""
        if self._store is None:
            raise RuntimeError("the API server is not running")
        return self._store

    async def astart(self) -> None:
        """Start serving on the running loop."""
        loop = asyncio.get_running_loop()
        self._loop = loop

        def schedule(callback: Callable[[], None]) -> None:
            loop.call_soon(callback)

        self._store = Store(history_size=self._history_size, schedule=schedule)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def astop(self) -> None:
        for queue in list(self._watch_queues):
            queue.put_nowait(CLOSE)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> ApiServer:
        """Serve from a daemon thread with its own loop; returns when it accepts requests."""
        self._runner_thread.start(START_TIMEOUT_S)
        return self

    def stop(self) -> None:
        """Stop the thread started by :meth:`start` (idempotent)."""
        self._runner_thread.stop(START_TIMEOUT_S)

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def call(self, fn: Callable[[Store], T], timeout: float = 10.0) -> T:
        """Run ``fn(store)`` on the server's loop from another thread; return its result."""
        if self._loop is None:
            raise RuntimeError("the API server is not running")

        async def run() -> T:
            return fn(self.store)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def write_kubeconfig(self, path: Path, *, namespace: str = "default") -> Path:
        return write_kubeconfig(path, self.url, namespace=namespace)

    # -- routing ---------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._route(request)
        except ApiError as exc:
            return json_response(exc.status(), exc.code)
        except SelectorError as exc:
            return json_response(bad_request(str(exc)).status(), 400)
        except Exception as exc:  # an emulator bug: say so in the answer and the log
            _log.exception("apiserver: %s %s failed", request.method, request.path_qs)
            error = ApiError(500, "InternalError", f"emulator error: {exc!r}")
            return json_response(error.status(), 500)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        segments = [s for s in request.path.split("/") if s]
        store = self.store
        if not segments:
            return json_response({"paths": ["/api", "/api/v1", "/apis", "/version", "/healthz"]})
        head = segments[0]
        if head == "openapi":
            return self._openapi(segments[1:])
        if head == "version" and len(segments) == 1:
            return json_response(version_info())
        if head in ("healthz", "livez", "readyz"):
            return web.Response(text="ok")
        if head == "api":
            if len(segments) == 1:
                return json_response(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [
                            {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.host}:{self.port}"}
                        ],
                    }
                )
            group, version, rest = "", segments[1], segments[2:]
        elif head == "apis":
            if len(segments) == 1:
                return json_response(
                    {
                        "kind": "APIGroupList",
                        "apiVersion": "v1",
                        "groups": group_list(self.store.types()),
                    }
                )
            if len(segments) == 2:
                found = [g for g in group_list(self.store.types()) if g["name"] == segments[1]]
                if not found:
                    raise ApiError(
                        404, "NotFound", "the server could not find the requested resource"
                    )
                return json_response({"kind": "APIGroup", "apiVersion": "v1", **found[0]})
            group, version, rest = segments[1], segments[2], segments[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            return json_response(resource_list(self.store.types(), group, version))
        namespace: str | None = None
        if (
            rest[0] == "namespaces"
            and len(rest) >= 3
            and not (group == "" and len(rest) == 3 and rest[2] in ("status", "finalize"))
        ):
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        rt = store.resolve(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if namespace is not None and not rt.namespaced:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if (
            sub is not None
            and sub not in rt.subresources
            and not (rt.plural == "namespaces" and sub == "finalize")
        ):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return await self._resource(request, rt, namespace, name, sub)

    def _openapi(self, rest: list[str]) -> web.Response:
        if rest == ["v2"]:
            # An empty protobuf message is an empty OpenAPI v2 document: kubectl finds no
            # schema for any type and skips client-side validation.
            return web.Response(body=b"", content_type=OPENAPI_V2_PROTOBUF)
        if rest == ["v3"]:
            return json_response(openapi_v3_root(self.store.types()))
        if len(rest) == 3 and rest[:2] == ["v3", "api"]:
            return json_response(openapi_v3_document(self.store.types(), "", rest[2]))
        if len(rest) == 4 and rest[:2] == ["v3", "apis"]:
            return json_response(openapi_v3_document(self.store.types(), rest[2], rest[3]))
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    # -- resources -------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        if not raw:
            return None
        content_type = request.headers.get("Content-Type", "application/json").lower()
        if "protobuf" in content_type:
            try:
                return protobuf.decode(raw)
            except ProtobufUnsupported as exc:
                raise ApiError(415, "UnsupportedMediaType", str(exc)) from exc
        try:
            if "yaml" in content_type:
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise bad_request(f"the request body is not valid JSON/YAML: {exc}") from exc

    def _out(self, rt: ResourceType, obj: Obj) -> Obj:
        if obj.get("apiVersion") != rt.api_version:
            return {**obj, "apiVersion": rt.api_version}
        return obj

    def _respond_object(
        self, request: web.Request, rt: ResourceType, obj: Obj, status: int = 200
    ) -> web.Response:
        rendering, version = negotiated(request)
        if rendering == "Table" and request.method == "GET":
            include = request.query.get("includeObject", "Metadata")
            rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
            table = render_table(
                rt,
                [self._out(rt, obj)],
                resource_version=rv,
                include_object=include,
                table_version=version or "v1",
            )
            return json_response(table, status)
        if rendering == "PartialObjectMetadata":
            return json_response(
                {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": f"meta.k8s.io/{version}",
                    "metadata": obj.get("metadata", {}),
                },
                status,
            )
        return json_response(self._out(rt, obj), status)

    async def _resource(
        self,
        request: web.Request,
        rt: ResourceType,
        namespace: str | None,
        name: str | None,
        sub: str | None,
    ) -> web.StreamResponse:
        store, query, method = self.store, request.query, request.method
        dry_run = query.get("dryRun") == "All"
        if name is None:
            labels = LabelSelector.parse(query.get("labelSelector"))
            fields = FieldSelector.parse(query.get("fieldSelector"))
            if method == "GET" and flag(query.get("watch")):
                return await self._watch(request, rt, namespace, labels, fields)
            if method == "GET":
                return self._list(request, rt, namespace, labels, fields)
            if method == "POST":
                obj = store.create(rt, namespace, await self._body(request), dry_run=dry_run)
                return json_response(self._out(rt, obj), 201)
            if method == "DELETE":
                options = self._delete_options(query, await self._body(request))
                items, _, _ = store.list_objects(rt, namespace, labels, fields)
                deleted = []
                for obj in items:
                    meta = obj["metadata"]
                    try:
                        deleted.append(
                            self._out(
                                rt,
                                store.delete(
                                    rt,
                                    meta.get("namespace"),
                                    meta["name"],
                                    options,
                                    dry_run=dry_run,
                                ),
                            )
                        )
                    except ApiError as exc:
                        if exc.code != 404:
                            raise
                return json_response(
                    {
                        "kind": f"{rt.kind}List",
                        "apiVersion": rt.api_version,
                        "metadata": {"resourceVersion": str(store.resource_version)},
                        "items": deleted,
                    }
                )
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        if sub == "log":
            if method != "GET":
                raise ApiError(405, "MethodNotAllowed", "pods/log only supports GET")
            return await serve_pod_log(request, self.store, self.logs_dir, namespace or "", name)
        if sub == "binding":
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "pods/binding only supports POST")
            body = await self._body(request) or {}
            node = (body.get("target") or {}).get("name")
            if not node:
                raise bad_request("a binding needs target.name")
            store.bind(namespace or "", name, node)
            return json_response(
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "metadata": {},
                    "status": "Success",
                    "code": 201,
                },
                201,
            )
        subresource = "status" if sub in ("status", "finalize") else None
        if method == "GET":
            return self._respond_object(request, rt, store.get(rt, namespace, name))
        if method == "PUT":
            obj = store.replace(
                rt,
                namespace,
                name,
                await self._body(request),
                subresource=subresource,
                dry_run=dry_run,
            )
            return json_response(self._out(rt, obj))
        if method == "PATCH":
            content_type = request.headers.get("Content-Type", "")
            obj = store.patch(
                rt,
                namespace,
                name,
                content_type,
                await self._body(request),
                subresource=subresource,
                dry_run=dry_run,
            )
            return json_response(self._out(rt, obj))
        if method == "DELETE":
            if sub is not None:
                raise ApiError(405, "MethodNotAllowed", "cannot delete a subresource")
            options = self._delete_options(query, await self._body(request))
            obj = store.delete(rt, namespace, name, options, dry_run=dry_run)
            return json_response(self._out(rt, obj))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    @staticmethod
    def _delete_options(query: Any, body: Any) -> Obj:
        options: Obj = dict(body) if isinstance(body, dict) else {}
        if "propagationPolicy" in query:
            options["propagationPolicy"] = query["propagationPolicy"]
        grace = int_param(query, "gracePeriodSeconds")
        if grace is not None:
            options["gracePeriodSeconds"] = grace
        if "orphanDependents" in query:
            options["orphanDependents"] = flag(query["orphanDependents"])
        return options

    def _list(
        self,
        request: web.Request,
        rt: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
    ) -> web.Response:
        limit = int_param(request.query, "limit") or 0
        items, rv, token = self.store.list_objects(
            rt,
            namespace,
            labels,
            fields,
            limit=limit,
            continue_token=request.query.get("continue", ""),
        )
        rendering, version = negotiated(request)
        out = [self._out(rt, obj) for obj in items]
        if rendering == "Table":
            include = request.query.get("includeObject", "Metadata")
            return json_response(
                render_table(
                    rt,
                    out,
                    resource_version=str(rv),
                    include_object=include,
                    table_version=version or "v1",
                    continue_token=token,
                )
            )
        metadata: Obj = {"resourceVersion": str(rv)}
        if token:
            metadata["continue"] = token
        if rendering in ("PartialObjectMetadata", "PartialObjectMetadataList"):
            return json_response(
                {
                    "kind": "PartialObjectMetadataList",
                    "apiVersion": f"meta.k8s.io/{version}",
                    "metadata": metadata,
                    "items": [
                        {
                            "kind": "PartialObjectMetadata",
                            "apiVersion": f"meta.k8s.io/{version}",
                            "metadata": o.get("metadata", {}),
                        }
                        for o in out
                    ],
                }
            )
        return json_response(
            {
                "kind": f"{rt.kind}List",
                "apiVersion": rt.api_version,
                "metadata": metadata,
                "items": out,
            }
        )

    async def _watch(
        self,
        request: web.Request,
        rt: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
    ) -> web.StreamResponse:
        query = request.query
        timeout = int_param(query, "timeoutSeconds")
        rendering, version = negotiated(request)
        watch = WatchRequest(
            rt=rt,
            namespace=namespace,
            labels=labels,
            fields=fields,
            resource_version=query.get("resourceVersion"),
            timeout_s=float(timeout) if timeout else DEFAULT_WATCH_TIMEOUT_S,
            bookmarks=flag(query.get("allowWatchBookmarks")),
            send_initial_events=flag(query.get("sendInitialEvents")),
            table_version=(version or "v1") if rendering == "Table" else None,
            include_object=query.get("includeObject", "Metadata"),
        )

        def register(queue: asyncio.Queue[WatchEvent | _Closing]) -> Callable[[], None]:
            self._watch_queues.add(queue)
            return lambda: self._watch_queues.discard(queue)

        return await serve_watch(
            request,
            self.store,
            watch,
            bookmark_interval_s=self.bookmark_interval_s,
            register=register,
        )
