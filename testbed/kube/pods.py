"""The kubelet's model of pods and containers, and everything it does without the API:
image entrypoints, argv and environment, ``fieldRef`` values, the status it reports, and
process groups (start, signal, reap)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "IMAGE_ENTRYPOINTS",
    "ConfigError",
    "Container",
    "Pod",
    "alive",
    "base_env",
    "container_argv",
    "container_env",
    "expand",
    "field_ref",
    "image_repository",
    "now",
    "pod_status",
    "reap",
    "signal_group",
    "spawn",
]

Obj = dict[str, Any]
Fetch = Callable[[str, str, str, bool], Awaitable[dict[str, str] | None]]

IMAGE_ENTRYPOINTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # repository (last path segment, no tag or digest): (ENTRYPOINT, CMD)
    "gradientmail": ((sys.executable, "-m", "gradientmail.cli"), ()),
    "python": ((), ("python3",)),
    "busybox": ((), ("sh",)),
    "alpine": ((), ("/bin/sh",)),
}
"""What a container runs when its spec gives no ``command``: Docker's ENTRYPOINT and CMD of
the images the project uses, mapped to local commands. The project's node image
(``…/gradientmail:TAG``) runs the CLI with this interpreter. ``args`` replaces CMD."""

_BASE_ENV_KEYS = ("HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH")


def image_repository(image: str) -> str:
    """``ghcr.io/org/gradientmail:0.1@sha256:…`` → ``gradientmail``."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.split(":", 1)[0]


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


_VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is ``$``."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_RE.sub(replace, text)


class ConfigError(Exception):
    """A container cannot start yet (missing Secret, ConfigMap or key)."""


@dataclass
class Container:
    name: str
    image: str
    spec: Obj
    init: bool
    process: subprocess.Popen[bytes] | None = None
    restart_count: int = 0
    state: Obj = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Obj = field(default_factory=dict)
    exit_code: int | None = None

    @property
    def running(self) -> bool:
        return "running" in self.state

    def status(self) -> Obj:
        entry: Obj = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.running,
            "started": self.running,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }
        if self.process is not None:
            entry["containerID"] = f"local://{self.process.pid}"
        return entry


@dataclass
class Pod:
    namespace: str
    name: str
    uid: str
    spec: Obj
    init_containers: list[Container]
    containers: list[Container]
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    phase: str = "Pending"
    reason: str | None = None
    message: str | None = None
    start_time: str | None = None
    initialized: bool = False
    terminating: bool = False
    task: asyncio.Task[None] | None = None
    conditions: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_written: Obj | None = None
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    def all_containers(self) -> list[Container]:
        return self.init_containers + self.containers


def container_argv(
    container: Container,
    env: Mapping[str, str],
    images: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]],
) -> list[str] | None:
    """``command`` + ``args`` with ``$(VAR)`` expanded, or the image's ENTRYPOINT + CMD."""
    spec = container.spec
    command, args = spec.get("command"), spec.get("args")
    if not command:
        known = images.get(image_repository(container.image))
        if known is None:
            return None
        command = list(known[0])
        if args is None:
            args = list(known[1])
    argv = [expand(str(a), env) for a in list(command) + list(args or [])]
    return argv or None


def base_env(pod: Pod, home: Path, api_url: str, extra: Mapping[str, str]) -> dict[str, str]:
    """What every container sees before its own ``env``: no host credentials."""
    venv_bin = str(Path(sys.executable).parent)
    env = {key: os.environ[key] for key in _BASE_ENV_KEYS if key in os.environ}
    env["PATH"] = os.pathsep.join([venv_bin, os.environ.get("PATH", "/usr/bin:/bin")])
    env.setdefault("HOME", str(home))
    env.setdefault("LANG", "C.UTF-8")
    env["HOSTNAME"] = pod.name
    env["PYTHONUNBUFFERED"] = "1"
    host_port = api_url.split("://", 1)[-1]
    host, _, port = host_port.partition(":")
    env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"] = host, port or "80"
    env.update(extra)
    return env


def field_ref(pod: Pod, path: str, node_name: str) -> str:
    """A ``fieldRef`` value."""
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
    if match:
        source = pod.labels if match.group(1) == "labels" else pod.annotations
        return source.get(match.group(2), "")
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "metadata.uid": pod.uid,
        "spec.nodeName": node_name,
        "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
        "status.podIP": "127.0.0.1",
        "status.hostIP": "127.0.0.1",
        "status.podIPs": "127.0.0.1",
    }
    return str(simple.get(path, ""))


async def container_env(
    pod: Pod, container: Container, node_name: str, fetch: Fetch
) -> dict[str, str]:
    """The container's own environment: ``envFrom``, then ``env`` in order (``$(VAR)`` sees
    the variables before it). ``fetch(namespace, kind, name, optional)`` reads a ConfigMap's
    or Secret's data (None when optional and missing; ConfigError when required)."""
    env: dict[str, str] = {}
    for source in container.spec.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, ref in (
            ("configmaps", source.get("configMapRef")),
            ("secrets", source.get("secretRef")),
        ):
            if ref is None:
                continue
            data = await fetch(pod.namespace, kind, ref.get("name", ""), bool(ref.get("optional")))
            for key, value in (data or {}).items():
                env[prefix + key] = value
    for item in container.spec.get("env") or []:
        name = item.get("name", "")
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom") or {}
        if "secretKeyRef" in source or "configMapKeyRef" in source:
            kind = "secrets" if "secretKeyRef" in source else "configmaps"
            ref = source.get("secretKeyRef") or source.get("configMapKeyRef") or {}
            optional = bool(ref.get("optional"))
            data = await fetch(pod.namespace, kind, ref.get("name", ""), optional)
            if data is None:
                continue
            key = ref.get("key", "")
            if key not in data:
                if optional:
                    continue
                what = "Secret" if kind == "secrets" else "ConfigMap"
                raise ConfigError(
                    f"couldn't find key {key} in {what} {pod.namespace}/{ref.get('name')}"
                )
            env[name] = data[key]
        elif "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"].get("fieldPath", ""), node_name)
        elif "resourceFieldRef" in source:
            resource = source["resourceFieldRef"].get("resource", "")
            kind, _, what = resource.partition(".")
            env[name] = str(
                ((container.spec.get("resources") or {}).get(kind) or {}).get(what, "0")
            )
    return env


def pod_status(pod: Pod) -> Obj:
    """The pod's whole ``status`` as the kubelet reports it."""
    moment = now()
    ready = (
        bool(pod.containers) and all(c.running for c in pod.containers) and pod.phase == "Running"
    )
    wanted = {
        "PodScheduled": "True",
        "Initialized": "True" if pod.initialized or not pod.init_containers else "False",
        "ContainersReady": "True" if ready else "False",
        "Ready": "True" if ready else "False",
    }
    conditions = []
    for kind, value in wanted.items():
        previous = pod.conditions.get(kind)
        if previous is None or previous[0] != value:
            pod.conditions[kind] = (value, moment)
        conditions.append(
            {"type": kind, "status": value, "lastTransitionTime": pod.conditions[kind][1]}
        )
    status: Obj = {
        "phase": pod.phase,
        "conditions": conditions,
        "hostIP": "127.0.0.1",
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "qosClass": "BestEffort",
        "containerStatuses": [c.status() for c in pod.containers],
    }
    if pod.init_containers:
        status["initContainerStatuses"] = [c.status() for c in pod.init_containers]
    if pod.start_time:
        status["startTime"] = pod.start_time
    if pod.reason:
        status["reason"] = pod.reason
    if pod.message:
        status["message"] = pod.message
    return status


def spawn(
    argv: list[str], log: Path, home: Path, working_dir: str | None, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """Start a container's process in its own session (so its own process group)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    cwd = Path(working_dir) if working_dir and Path(working_dir).is_dir() else home
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def reap(process: subprocess.Popen[bytes]) -> int:
    """Collect a process known to have exited (does not block)."""
    return process.wait()


def signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the process group, unless the leader was reaped (its id may be reused)."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)


def alive(process: subprocess.Popen[bytes]) -> bool:
    try:
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False
