"""The operator benchmark's moving parts: the API server stand-in with a timed request log,
S3 stand-ins (an empty store that answers, and one that accepts connections and never
answers), the operator as a real ``kopf run`` of another checkout's ``handlers.py``, and the
runs and pod status the benchmark writes in place of users and a kubelet.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from bench._operator_log import BENCH_AGENT, Entry
from testbed.kube.apiserver import ApiServer
from testbed.kube.client import KubeApi, KubeApiError
from testbed.processes import ManagedProcess
from testbed.stub_s3 import Reply, Request, error_xml, stub_s3

NAMESPACE = "default"
GROUP, VERSION, PLURAL = "gradientmail.dev", "v1alpha1", "gradientmailruns"
RUNS_PATH = f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
PODS_PATH = f"/api/v1/namespaces/{NAMESPACE}/pods"
LABEL_RUN = f"{GROUP}/run"
LABEL_INDEX = f"{GROUP}/node-index"
SECRET = "bench-s3-credentials"
BUCKET = "bench"


class LoggingApiServer(ApiServer):
    """:class:`ApiServer` that records every request with its arrival time."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._log: list[Entry] = []
        self._log_lock = threading.Lock()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch", "").lower() in ("1", "true")
        entry = Entry(
            time.monotonic(),
            request.method,
            request.path,
            watch,
            request.headers.get("User-Agent", ""),
        )
        with self._log_lock:
            self._log.append(entry)
        return await super()._handle(request)

    def entries(self) -> list[Entry]:
        with self._log_lock:
            return list(self._log)

    def count_since(self, t0: float) -> int:
        with self._log_lock:
            return sum(1 for e in self._log if e.t >= t0 and e.agent != BENCH_AGENT)


# -- S3 stand-ins ----------------------------------------------------------------------------


def _empty_store(request: Request) -> Reply:
    """An empty bucket: listings list nothing, reads find nothing, writes succeed."""
    parts = [p for p in request.path.split("/") if p]
    if request.method == "GET" and len(parts) <= 1:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{BUCKET}</Name><Prefix></Prefix><KeyCount>0</KeyCount>"
            "<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>"
        ).encode()
        return Reply(200, body, {"Content-Type": "application/xml"})
    if request.method in ("GET", "HEAD"):
        if len(parts) <= 1:
            return Reply(200)
        return Reply(404, error_xml("NoSuchKey"), {"Content-Type": "application/xml"})
    if request.method == "DELETE":
        return Reply(204)
    if request.method == "POST":  # DeleteObjects
        body = b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult></DeleteResult>'
        return Reply(200, body, {"Content-Type": "application/xml"})
    return Reply(200, b"", {"ETag": '"0"'})


@contextmanager
def empty_s3() -> Iterator[tuple[str, list[Request]]]:
    """An S3 endpoint with an empty bucket; yields (endpoint, its request log)."""
    with stub_s3(_empty_store) as stub:
        yield stub.endpoint_url, stub.requests


@contextmanager
def hanging_s3(max_connections: int = 512) -> Iterator[tuple[str, list[float]]]:
    """An endpoint that accepts connections and never answers (nor reads): a hung store.
    Yields (endpoint, the times connections were accepted)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    accepted: list[float] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(time.monotonic())
            held.append(conn)
            while len(held) > max_connections:
                held.pop(0).close()

    thread = threading.Thread(target=serve, name="hanging-s3", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


# -- the operator ------------------------------------------------------------------------------


def operator_env(source: Path, kubeconfig: Path, workdir: Path) -> dict[str, str]:
    """This environment for the operator: the kubeconfig, ``source`` first on PYTHONPATH
    (ahead of the editable installs in the venv), and no GRADIENTMAIL_OPERATOR_* settings, so
    that the operator runs with its defaults."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GRADIENTMAIL_OPERATOR_")
        and k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "PYTHONPATH")
    }
    env["KUBECONFIG"] = str(kubeconfig)
    env["KUBECACHEDIR"] = str(workdir / "kube-cache")
    env["PYTHONPATH"] = os.pathsep.join([str(source / "operator"), str(source)])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def check_imports(source: Path, env: dict[str, str]) -> dict[str, str]:
    """Where the operator's interpreter, in the operator's environment and working
    directory, imports ``gradientmail`` and ``gradientmail_operator`` from; raises unless
    both come from ``source``."""
    code = (
        "import gradientmail, gradientmail_operator, kopf; "
        "print(gradientmail.__file__); print(gradientmail_operator.__file__); "
        "print(kopf.__version__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=source,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the operator's imports fail from {source}: {result.stderr}")
    library, operator, kopf_version = result.stdout.split()
    found = {"gradientmail": library, "gradientmail_operator": operator, "kopf": kopf_version}
    for name in ("gradientmail", "gradientmail_operator"):
        if not Path(found[name]).resolve().is_relative_to(source.resolve()):
            raise RuntimeError(f"{name} imports from {found[name]}, not from {source}")
    return found


def start_operator(source: Path, env: dict[str, str], log: Path) -> ManagedProcess:
    """``python -m kopf run --standalone --all-namespaces <source>/.../handlers.py`` in
    ``source`` (the chart's default scope; kopf's default log level, as the chart's)."""
    handlers = source / "operator" / "gradientmail_operator" / "handlers.py"
    argv = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces"]
    return ManagedProcess([*argv, str(handlers)], log_path=log, env=env, cwd=source)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (NaN once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- what the benchmark writes -----------------------------------------------------------------


def bench_api(url: str) -> KubeApi:
    api = KubeApi(url)
    api.session.headers["User-Agent"] = BENCH_AGENT
    return api


def install(api: KubeApi, crd: Path, endpoint: str | None) -> None:
    """The CRD, and (for S3 mailboxes) the credentials Secret the runs name."""
    api.create(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", yaml.safe_load(crd.read_text())
    )
    for _ in range(100):  # the stand-in establishes CRDs at once; bounded all the same
        with contextlib.suppress(KubeApiError):
            api.get(RUNS_PATH)
            break
        time.sleep(0.1)
    if endpoint is not None:
        api.create(
            f"/api/v1/namespaces/{NAMESPACE}/secrets",
            {
                "metadata": {"name": SECRET},
                "stringData": {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"},
            },
        )


def mailbox(endpoint: str | None, file_root: Path) -> dict[str, Any]:
    if endpoint is None:
        return {"url": file_root.as_uri()}
    return {
        "endpoint": endpoint,
        "bucket": BUCKET,
        "prefix": "runs",
        "credentialsSecret": {"name": SECRET},
    }


def create_run(api: KubeApi, name: str, box: dict[str, Any], nodes: int) -> None:
    api.create(
        RUNS_PATH,
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "GradientMailRun",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "nodes": nodes,
                "mailbox": box,
                "algorithm": {"syncEvery": 10, "fragments": 1, "steps": 1_000_000},
                "maxRestarts": 1000,
            },
        },
    )


def runs(api: KubeApi) -> list[dict[str, Any]]:
    return list(api.get(RUNS_PATH)["items"])


def pods(api: KubeApi) -> list[dict[str, Any]]:
    return list(api.get(PODS_PATH, labelSelector=LABEL_RUN)["items"])


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def pod_status(pod: dict[str, Any], phase: str) -> dict[str, Any]:
    """The status a kubelet would write for a pod whose one container is running, has
    exited 0 (Succeeded) or 1 (Failed)."""
    started = now_rfc3339()
    containers = pod.get("spec", {}).get("containers") or [{"name": "node", "image": "?"}]
    running = phase == "Running"
    if running:
        state: dict[str, Any] = {"running": {"startedAt": started}}
    else:
        code = 0 if phase == "Succeeded" else 1
        state = {
            "terminated": {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": started,
                "finishedAt": started,
            }
        }
    ready = "True" if running else "False"
    return {
        "phase": phase,
        "hostIP": "127.0.0.1",
        "podIP": "127.0.0.1",
        "startTime": started,
        "conditions": [
            {"type": t, "status": s, "lastTransitionTime": started}
            for t, s in (
                ("PodScheduled", "True"),
                ("Initialized", "True"),
                ("ContainersReady", ready),
                ("Ready", ready),
            )
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c.get("image", "?"),
                "imageID": "",
                "containerID": f"bench://{pod['metadata']['name']}",
                "ready": running,
                "started": running,
                "restartCount": 0,
                "state": state,
            }
            for c in containers
        ],
    }


def set_pod_phase(api: KubeApi, pod: dict[str, Any], phase: str) -> None:
    name = pod["metadata"]["name"]
    with contextlib.suppress(KubeApiError):  # gone meanwhile: the operator deleted it
        api.patch(f"{PODS_PATH}/{name}/status", {"status": pod_status(pod, phase)})
