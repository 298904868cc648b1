"""A local kubelet: runs the emulator's pods as processes on this machine.

It registers a Node, watches all pods, binds unscheduled ones to itself (``pods/binding``:
it is the scheduler too), and for each pod bound to it:

* resolves every container's environment: ``value`` (with ``$(VAR)`` expansion),
  ``valueFrom.secretKeyRef`` / ``configMapKeyRef`` (``optional`` honoured), ``fieldRef``
  (metadata.name/namespace/uid/labels/annotations, spec.nodeName, spec.serviceAccountName,
  status.podIP/hostIP) and ``envFrom``; a missing Secret or ConfigMap leaves the container
  waiting with ``CreateContainerConfigError`` and is retried;
* runs init containers one after another, then the containers, each as a process in its own
  process group: ``command`` + ``args`` (``$(VAR)`` expanded), or the image's entrypoint from
  :data:`IMAGE_ENTRYPOINTS` when ``command`` is absent. The image itself is never pulled.
  Processes see only a small base environment (PATH with this venv's ``bin`` first, so
  ``python`` and ``gradientmail`` are this venv's; HOME, LANG, TZ, TMPDIR, PYTHONPATH;
  PYTHONUNBUFFERED=1; the ``KUBERNETES_SERVICE_*`` pair) plus what the pod spec says: host
  credentials never leak into a pod. ``workingDir`` is used when it exists;
* writes the pod's status back: phase, conditions (PodScheduled, Initialized,
  ContainersReady, Ready), hostIP/podIP 127.0.0.1, startTime, and containerStatuses with
  running/terminated/waiting states, exit codes (128+N after signal N), restart counts;
* restartPolicy: Never runs once; OnFailure restarts after a non-zero exit, Always after any
  exit, both at most ``max_restarts`` times (then the container waits in CrashLoopBackOff);
* logs: stdout and stderr to ``<logs_dir>/<ns>/<pod>/<uid>/<container>.log`` (the previous
  run of a restarted container in ``.previous.log``), which the API server serves as
  ``pods/log`` (``kubectl logs``) when both share ``logs_dir``;
* a pod deleted while running (it keeps a deletionTimestamp, see ``store.py``) gets SIGTERM
  to its process groups, SIGKILL after its grace period (at most ``max_grace_s``), a final
  status, and then the kubelet confirms the deletion with ``gracePeriodSeconds=0``. A pod
  that vanished outright has its processes killed the same way;
* bounds: at most ``max_pods`` pods run at once (the rest stay Pending until a slot frees);
  a pod runs at most ``activeDeadlineSeconds`` or ``max_runtime_s`` (then DeadlineExceeded);
  :meth:`Kubelet.stop` kills every process group it started.

Tests reach in with :meth:`Kubelet.kill` (signal a pod's processes, as an OOM kill or a node
failure would), :meth:`Kubelet.pid` and :meth:`Kubelet.logs`.

Not emulated: volumes and mounts (``emptyDir`` and friends are ignored), probes (a running
container is ready), resources and limits, ports and networking (every pod is 127.0.0.1),
security contexts, ephemeral and sidecar containers, image pulls.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from testbed.kube.logs import pod_log_path, read_log
from testbed.kube.pods import (
    IMAGE_ENTRYPOINTS,
    ConfigError,
    Container,
    Pod,
    alive,
    base_env,
    container_argv,
    container_env,
    image_repository,
    now,
    pod_status,
    reap,
    signal_group,
    spawn,
)
from testbed.loop_thread import LoopThread

__all__ = ["IMAGE_ENTRYPOINTS", "Kubelet", "image_repository"]

Obj = dict[str, Any]
T = TypeVar("T")

_log = logging.getLogger(__name__)
_POLL_S = 0.05
_CONFIG_RETRY_S = 1.0
_STOP_GRACE_S = 2.0
_HTTP_TIMEOUT_S = 10.0
_WATCH_TIMEOUT_S = 60


class _ApiGone(Exception):
    """The object is gone (404)."""


class Kubelet:
    """Runs the pods of the API server at ``api_url`` as local processes (see module doc)."""

    def __init__(
        self,
        api_url: str,
        *,
        logs_dir: Path,
        workdir: Path,
        node_name: str = "gradientmail-node",
        max_pods: int = 16,
        max_runtime_s: float = 600.0,
        max_grace_s: float = 5.0,
        max_restarts: int = 3,
        images: Mapping[str, tuple[Sequence[str], Sequence[str]]] | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.api_url = api_url.rstrip("/")
        self.logs_dir = Path(logs_dir)
        self.workdir = Path(workdir)
        self.node_name = node_name
        self.max_pods = max_pods
        self.max_runtime_s = max_runtime_s
        self.max_grace_s = max_grace_s
        self.max_restarts = max_restarts
        self.images: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = dict(IMAGE_ENTRYPOINTS)
        for repository, (entrypoint, cmd) in (images or {}).items():
            self.images[repository] = (tuple(entrypoint), tuple(cmd))
        self.extra_env = dict(extra_env or {})
        self._pods: dict[str, Pod] = {}  # by uid
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._main: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner_thread = LoopThread("kubelet", self.astart, self.astop)
        self.synced = threading.Event()
        """Set once the first pod list has been handled."""

    # -- lifecycle -------------------------------------------------------------------------

    async def astart(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        self._slots = asyncio.Semaphore(self.max_pods)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=_HTTP_TIMEOUT_S)
        )
        await self._register_node()
        self._main = asyncio.create_task(self._watch_pods(), name="kubelet-watch")

    async def astop(self) -> None:
        if self._main is not None:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._main
        for task in list(self._tasks):
            task.cancel()
        pods = list(self._pods.values())
        for pod in pods:
            pod.terminating = True
            if pod.task is not None:
                pod.task.cancel()
        for pod in pods:
            await self._kill_all(pod, _STOP_GRACE_S)
            if pod.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await pod.task
        self._pods.clear()
        if self._session is not None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                await self._request("DELETE", f"/api/v1/nodes/{self.node_name}", timeout=2.0)
            await self._session.close()
            self._session = None

    def start(self) -> Kubelet:
        """Run in a daemon thread with its own loop; returns once the node is registered."""
        self._runner_thread.start(_HTTP_TIMEOUT_S * 2)
        return self

    def stop(self) -> None:
        """Kill every process it started and stop the thread (idempotent)."""
        self._runner_thread.stop(self.max_grace_s + _STOP_GRACE_S + 10.0)

    def __enter__(self) -> Kubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- test hooks (thread-safe) ----------------------------------------------------------

    def _call(self, coroutine: Any, timeout: float = 10.0) -> Any:
        if self._loop is None or self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("the kubelet is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _find(self, namespace: str, name: str, container: str | None) -> Container:
        pods = [p for p in self._pods.values() if p.key == (namespace, name) and not p.terminating]
        if not pods:
            raise LookupError(f"no pod {namespace}/{name} on this kubelet")
        candidates = [
            c for c in pods[-1].all_containers() if container in (None, c.name) and c.running
        ]
        if not candidates:
            raise LookupError(f"no running container {container or ''} in pod {namespace}/{name}")
        return candidates[0]

    def kill(
        self, namespace: str, name: str, container: str | None = None, sig: int = signal.SIGKILL
    ) -> int:
        """Send ``sig`` to a running container's process group; returns its pid."""

        async def run() -> int:
            target = self._find(namespace, name, container)
            assert target.process is not None
            signal_group(target.process, sig)
            return target.process.pid

        return int(self._call(run()))

    def pid(self, namespace: str, name: str, container: str | None = None) -> int | None:
        """The pid of a running container's process, or None."""

        async def run() -> int | None:
            try:
                target = self._find(namespace, name, container)
            except LookupError:
                return None
            return target.process.pid if target.process is not None else None

        result: int | None = self._call(run())
        return result

    def pids(self) -> list[int]:
        """Every process this kubelet has running."""

        async def run() -> list[int]:
            return [
                c.process.pid
                for p in self._pods.values()
                for c in p.all_containers()
                if c.process is not None and c.process.returncode is None
            ]

        result: list[int] = self._call(run())
        return result

    def logs(
        self, namespace: str, name: str, container: str | None = None, *, uid: str | None = None
    ) -> str:
        """The current log of a container of a pod this kubelet knows ("" if none yet)."""

        async def run() -> Path | None:
            for pod in reversed(list(self._pods.values())):
                if pod.key == (namespace, name) and uid in (None, pod.uid):
                    names = [c.name for c in pod.all_containers()]
                    chosen = container or pod.containers[0].name
                    if chosen in names:
                        return pod_log_path(self.logs_dir, namespace, name, pod.uid, chosen)
            return None

        path = self._call(run())
        return read_log(path).decode(errors="replace") if path is not None else ""

    # -- API -------------------------------------------------------------------------------

    async def _request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str | None = None,
        timeout: float = _HTTP_TIMEOUT_S,
    ) -> Any:
        assert self._session is not None
        headers = {"Content-Type": content_type or "application/json"}
        data = None if body is None else json.dumps(body).encode()
        async with self._session.request(
            method,
            self.api_url + path,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            if response.status == 404:
                raise _ApiGone(path)
            body = await response.json(content_type=None)
            if response.status >= 400:
                raise aiohttp.ClientResponseError(
                    response.request_info,
                    (),
                    status=response.status,
                    message=str(body.get("message", body)),
                )
            return body

    async def _register_node(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "labels": {"kubernetes.io/hostname": self.node_name},
            },
        }
        with contextlib.suppress(aiohttp.ClientResponseError):  # 409: already registered
            await self._request("POST", "/api/v1/nodes", body=node)
        status = {
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "local kubelet emulator is posting ready status",
                        "lastHeartbeatTime": now(),
                        "lastTransitionTime": now(),
                    }
                ],
                "addresses": [
                    {"type": "InternalIP", "address": "127.0.0.1"},
                    {"type": "Hostname", "address": self.node_name},
                ],
                "capacity": {"pods": str(self.max_pods)},
                "allocatable": {"pods": str(self.max_pods)},
                "nodeInfo": {
                    "kubeletVersion": "v1.33.0-gradientmail",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            }
        }
        await self._request(
            "PATCH",
            f"/api/v1/nodes/{self.node_name}/status",
            body=status,
            content_type="application/merge-patch+json",
        )

    async def _watch_pods(self) -> None:
        """List, then watch from the list's version; relist on 410 or a broken stream."""
        assert self._session is not None
        while True:
            try:
                listing = await self._request("GET", "/api/v1/pods")
                for pod in listing.get("items", []):
                    await self._reconcile(pod, deleted=False)
                live = {p["metadata"]["uid"] for p in listing.get("items", [])}
                for uid in [uid for uid in self._pods if uid not in live]:
                    await self._forget(self._pods[uid])
                self.synced.set()
                rv = listing["metadata"]["resourceVersion"]
                while True:
                    url = (
                        f"{self.api_url}/api/v1/pods?watch=true&allowWatchBookmarks=true"
                        f"&timeoutSeconds={_WATCH_TIMEOUT_S}&resourceVersion={rv}"
                    )
                    async with self._session.get(
                        url, timeout=aiohttp.ClientTimeout(total=90)
                    ) as response:
                        async for line in response.content:
                            if not line.strip():
                                continue
                            event = _json_loads(line)
                            kind, obj = event.get("type"), event.get("object") or {}
                            if kind == "ERROR":
                                raise _ApiGone("watch expired")
                            rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                            if kind in ("ADDED", "MODIFIED", "DELETED"):
                                await self._reconcile(obj, deleted=kind == "DELETED")
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, OSError, TimeoutError, _ApiGone, ValueError):
                await asyncio.sleep(0.2)
            except Exception:  # a bug here must not silently stop every pod
                _log.exception("kubelet: the pod watch failed; listing again")
                await asyncio.sleep(0.5)

    async def _reconcile(self, obj: Obj, *, deleted: bool) -> None:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        uid = meta.get("uid", "")
        known = self._pods.get(uid)
        if deleted:
            if known is not None:
                await self._forget(known)
            return
        node = spec.get("nodeName")
        if not node:
            if spec.get(
                "schedulerName", "default-scheduler"
            ) == "default-scheduler" and not meta.get("deletionTimestamp"):
                binding = {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": meta["name"]},
                    "target": {"kind": "Node", "name": self.node_name},
                }
                with contextlib.suppress(aiohttp.ClientResponseError, _ApiGone):
                    await self._request(
                        "POST",
                        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                        body=binding,
                    )
            return
        if node != self.node_name:
            return
        if meta.get("deletionTimestamp"):
            if known is None or known.terminating:
                if known is None:
                    self._background(self._confirm_deletion(meta))
                return
            known.terminating = True
            grace = min(float(meta.get("deletionGracePeriodSeconds") or 0), self.max_grace_s)
            self._background(self._terminate(known, grace, confirm=True))
            return
        if known is not None:
            return
        if (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return  # finished before this kubelet started
        pod = self._make_pod(obj)
        self._pods[uid] = pod
        pod.task = asyncio.create_task(self._lifecycle(pod), name=f"pod-{pod.namespace}-{pod.name}")

    def _background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _make_pod(self, obj: Obj) -> Pod:
        meta, spec = obj["metadata"], obj.get("spec") or {}

        def containers(key: str, init: bool) -> list[Container]:
            return [
                Container(name=c.get("name", ""), image=c.get("image", ""), spec=c, init=init)
                for c in spec.get(key) or []
            ]

        return Pod(
            namespace=meta.get("namespace", "default"),
            name=meta["name"],
            uid=meta["uid"],
            spec=spec,
            init_containers=containers("initContainers", True),
            containers=containers("containers", False),
            labels=dict(meta.get("labels") or {}),
            annotations=dict(meta.get("annotations") or {}),
        )

    # -- one pod ---------------------------------------------------------------------------

    async def _lifecycle(self, pod: Pod) -> None:
        assert self._slots is not None
        deadline = float(pod.spec.get("activeDeadlineSeconds") or self.max_runtime_s)
        await self._write_status(pod)
        async with self._slots:
            if pod.terminating:
                return
            pod.start_time = now()
            try:
                async with asyncio.timeout(min(deadline, self.max_runtime_s)):
                    await self._run_pod(pod)
            except TimeoutError:
                pod.phase, pod.reason = "Failed", "DeadlineExceeded"
                pod.message = f"Pod was active on the node longer than {deadline:g} s"
                await self._kill_all(pod, 0.0)
            except Exception as exc:  # a kubelet bug: fail the pod visibly, do not hang
                _log.exception("kubelet: pod %s/%s failed", pod.namespace, pod.name)
                pod.phase, pod.reason, pod.message = "Failed", "KubeletError", repr(exc)
                await self._kill_all(pod, 0.0)
            for container in pod.all_containers():
                if container.running:  # killed above: its waiter was cancelled
                    container.exit_code = 128 + signal.SIGKILL
                    container.state = {
                        "terminated": {
                            "exitCode": container.exit_code,
                            "reason": pod.reason or "Error",
                            "signal": int(signal.SIGKILL),
                            "startedAt": container.state["running"].get("startedAt"),
                            "finishedAt": now(),
                        }
                    }
            if not pod.terminating:
                await self._write_status(pod)

    async def _run_pod(self, pod: Pod) -> None:
        envs: dict[str, dict[str, str]] = {}
        while not pod.terminating:
            try:
                for container in pod.all_containers():
                    envs[container.name] = await container_env(
                        pod, container, self.node_name, self._config_data
                    )
                break
            except ConfigError as exc:
                for container in pod.all_containers():
                    container.state = {
                        "waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}
                    }
                await self._write_status(pod)
                await asyncio.sleep(_CONFIG_RETRY_S)
        for container in pod.init_containers:
            if not await self._run_container(pod, container, envs[container.name]):
                pod.phase = "Failed"
                return
        pod.initialized = True
        if pod.terminating:
            return
        results = await asyncio.gather(
            *(self._run_container(pod, c, envs[c.name]) for c in pod.containers)
        )
        if pod.terminating:
            return
        if all(c.exit_code is not None for c in pod.containers):
            pod.phase = "Succeeded" if all(results) else "Failed"

    async def _run_container(self, pod: Pod, container: Container, env: dict[str, str]) -> bool:
        """Run (and restart per policy) until done; True when it ended with exit code 0."""
        policy = pod.spec.get("restartPolicy", "Always")
        if container.init and policy == "Always":
            policy = "OnFailure"
        while True:
            code = await self._run_once(pod, container, env)
            if code is None:
                return False
            if pod.terminating:
                return code == 0
            if policy == "Never" or (policy == "OnFailure" and code == 0):
                return code == 0
            if container.restart_count >= self.max_restarts:
                container.last_state = container.state
                container.state = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"restarted {container.restart_count} times",
                    }
                }
                container.exit_code = None
                await self._write_status(pod)
                return False
            await asyncio.sleep(min(0.1 * 2**container.restart_count, 2.0))
            container.restart_count += 1
            container.last_state = container.state
            log = pod_log_path(self.logs_dir, pod.namespace, pod.name, pod.uid, container.name)
            with contextlib.suppress(FileNotFoundError):
                os.replace(
                    log,
                    pod_log_path(
                        self.logs_dir,
                        pod.namespace,
                        pod.name,
                        pod.uid,
                        container.name,
                        previous=True,
                    ),
                )

    async def _run_once(self, pod: Pod, container: Container, env: dict[str, str]) -> int | None:
        """Start the process and wait for it; its exit code, or None if it could not start."""
        argv = container_argv(container, env, self.images)
        if argv is None:
            container.state = {
                "waiting": {
                    "reason": "ErrImageNeverPull",
                    "message": f"the local kubelet cannot run image {container.image!r}: give "
                    "the container a command, or map the image in IMAGE_ENTRYPOINTS "
                    "(testbed/kube/kubelet.py)",
                }
            }
            await self._write_status(pod)
            return None
        log = pod_log_path(self.logs_dir, pod.namespace, pod.name, pod.uid, container.name)
        home = self.workdir / pod.namespace / pod.name / pod.uid
        started = now()
        try:
            container.process = spawn(
                argv,
                log,
                home,
                container.spec.get("workingDir"),
                base_env(pod, home, self.api_url, self.extra_env) | env,
            )
        except OSError as exc:
            container.state = {
                "terminated": {
                    "exitCode": 128,
                    "reason": "StartError",
                    "message": str(exc),
                    "startedAt": started,
                    "finishedAt": now(),
                }
            }
            container.exit_code = 128
            await self._write_status(pod)
            return 128
        container.state = {"running": {"startedAt": started}}
        container.exit_code = None
        if pod.phase == "Pending" and (not container.init):
            pod.phase = "Running"
        await self._write_status(pod)
        code = await self._wait_exit(container.process)
        terminated: Obj = {
            "exitCode": code if code >= 0 else 128 - code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": started,
            "finishedAt": now(),
            "containerID": f"local://{container.process.pid}",
        }
        if code < 0:
            terminated["signal"] = -code
        container.state = {"terminated": terminated}
        container.exit_code = terminated["exitCode"]
        await self._write_status(pod)
        return int(terminated["exitCode"])

    @staticmethod
    async def _wait_exit(process: subprocess.Popen[bytes]) -> int:
        """Wait without reaping, kill what is left of the group, then reap: the group id
        cannot be reused while we may still signal it."""
        while alive(process):
            await asyncio.sleep(_POLL_S)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        return reap(process)

    async def _config_data(
        self, namespace: str, kind: str, name: str, optional: bool
    ) -> dict[str, str] | None:
        try:
            obj = await self._request("GET", f"/api/v1/namespaces/{namespace}/{kind}/{name}")
        except _ApiGone:
            if optional:
                return None
            raise ConfigError(f'{kind[:-1]} "{name}" not found') from None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ConfigError(f'cannot read {kind[:-1]} "{name}": {exc!r}') from exc
        data = dict(obj.get("data") or {})
        if kind == "secrets":
            return {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        return {k: str(v) for k, v in data.items()}

    # -- status ----------------------------------------------------------------------------

    async def _write_status(self, pod: Pod) -> None:
        async with pod.write_lock:
            status = pod_status(pod)
            if status == pod.last_written:
                return
            patch = {"metadata": {"uid": pod.uid}, "status": status}
            try:
                await self._request(
                    "PATCH",
                    f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
                    body=patch,
                    content_type="application/merge-patch+json",
                )
                pod.last_written = status
            except (_ApiGone, aiohttp.ClientError, OSError, TimeoutError):
                pass  # gone or replaced; a later write or the deletion settles it

    # -- ending pods -----------------------------------------------------------------------

    async def _kill_all(self, pod: Pod, grace: float) -> None:
        """SIGTERM every process group of the pod, SIGKILL after ``grace`` s, reap."""
        running = [
            c.process
            for c in pod.all_containers()
            if c.process is not None and c.process.returncode is None
        ]
        for process in running:
            signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(p) for p in running):
            await asyncio.sleep(_POLL_S)
        for process in running:
            signal_group(process, signal.SIGKILL)
        deadline = time.monotonic() + _STOP_GRACE_S
        while time.monotonic() < deadline and any(alive(p) for p in running):
            await asyncio.sleep(_POLL_S)
        for process in running:
            if not alive(process):
                reap(process)

    async def _terminate(self, pod: Pod, grace: float, *, confirm: bool) -> None:
        await self._kill_all(pod, grace)
        if pod.task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(pod.task), timeout=_STOP_GRACE_S)
            except TimeoutError:
                pod.task.cancel()  # still waiting for a slot or a config retry
            except asyncio.CancelledError:
                if not pod.task.cancelled():
                    raise
        if confirm:
            if pod.phase in ("Pending", "Running"):
                pod.phase = (
                    "Failed"
                    if any(c.exit_code not in (None, 0) for c in pod.containers)
                    else "Succeeded"
                )
            await self._write_status(pod)
            await self._confirm_deletion(
                {"namespace": pod.namespace, "name": pod.name, "uid": pod.uid}
            )
        self._pods.pop(pod.uid, None)

    async def _forget(self, pod: Pod) -> None:
        pod.terminating = True
        await self._terminate(pod, min(1.0, self.max_grace_s), confirm=False)

    async def _confirm_deletion(self, meta: Obj) -> None:
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta.get("uid")},
        }
        with contextlib.suppress(_ApiGone, aiohttp.ClientError, OSError, TimeoutError):
            await self._request(
                "DELETE",
                f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                body=options,
            )


def _json_loads(line: bytes) -> Obj:
    value = json.loads(line)
    return value if isinstance(value, dict) else {}
