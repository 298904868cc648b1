"""Where the kubelet writes container logs and how the API server serves them (``pods/log``).

Layout: ``<logs_dir>/<namespace>/<pod>/<pod uid>/<container>.log`` (stdout and stderr
together); the previous run of a restarted container is ``<container>.previous.log``. The uid
keeps a recreated pod of the same name from reading its predecessor's log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from testbed.kube.errors import bad_request
from testbed.kube.http_util import flag, int_param

if TYPE_CHECKING:
    from testbed.kube.store import Store

__all__ = ["pod_log_path", "read_log", "serve_pod_log"]

Obj = dict[str, Any]
LOG_FOLLOW_POLL_S = 0.1
LOG_FOLLOW_MAX_S = 3600.0


def pod_log_path(
    logs_dir: Path, namespace: str, pod: str, uid: str, container: str, *, previous: bool = False
) -> Path:
    suffix = ".previous.log" if previous else ".log"
    return Path(logs_dir) / namespace / pod / uid / f"{container}{suffix}"


def read_log(path: Path, *, tail_lines: int | None = None, limit_bytes: int | None = None) -> bytes:
    """The log's bytes ("" if missing), cut to the last ``tail_lines`` and first ``limit_bytes``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return b""
    if tail_lines is not None:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-tail_lines:]) if tail_lines > 0 else b""
    if limit_bytes is not None:
        data = data[:limit_bytes]
    return data


async def serve_pod_log(
    request: web.Request, store: Store, logs_dir: Path | None, namespace: str, name: str
) -> web.StreamResponse:
    """``GET pods/{name}/log``: container, previous, tailLines, limitBytes, follow."""
    pod_type = store.resolve("", "v1", "pods")
    pod = store.get(pod_type, namespace, name)
    uid = pod["metadata"]["uid"]
    spec = pod.get("spec") or {}
    names = [
        c.get("name") for c in (spec.get("containers") or []) + (spec.get("initContainers") or [])
    ]
    container = request.query.get("container")
    if not container:
        main = [c.get("name") for c in spec.get("containers") or []]
        if len(main) != 1:
            raise bad_request(
                f"a container name must be specified for pod {name}, choose one of: {main}"
            )
        container = main[0]
    if container not in names:
        raise bad_request(f"container {container} is not valid for pod {name}")
    if logs_dir is None:
        raise bad_request("the emulator was started without a logs directory (logs_dir)")
    previous = flag(request.query.get("previous"))
    path = pod_log_path(logs_dir, namespace, name, uid, container, previous=previous)
    if not path.exists():
        if previous:
            raise bad_request(
                f'previous terminated container "{container}" in pod "{name}" not found'
            )
        if (pod.get("status") or {}).get("phase", "Pending") == "Pending":
            raise bad_request(
                f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating'
            )
    tail = int_param(request.query, "tailLines")
    limit = int_param(request.query, "limitBytes")
    data = read_log(path, tail_lines=tail, limit_bytes=limit)
    if not flag(request.query.get("follow")):
        return web.Response(body=data, content_type="text/plain")
    response = web.StreamResponse(headers={"Content-Type": "text/plain"})
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(data)
    offset = len(read_log(path)) if tail is not None else len(data)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LOG_FOLLOW_MAX_S
    try:
        while loop.time() < deadline:
            current = store.find(pod_type, namespace, name)
            finished = (
                current is None
                or current["metadata"]["uid"] != uid
                or _container_done(current, container)
            )
            chunk = read_log(path)[offset:]
            if chunk:
                await response.write(chunk)
                offset += len(chunk)
            if finished or request.transport is None or request.transport.is_closing():
                break
            await asyncio.sleep(LOG_FOLLOW_POLL_S)
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


def _container_done(pod: Obj, container: str) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    for cs in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
        if cs.get("name") == container and "terminated" in (cs.get("state") or {}):
            return True
    return False
