"""pytest fixtures: an emulated cluster per test, with kubectl and kopf at hand.

Fixtures (add ``pytest_plugins = ["testbed.kube.fixtures"]`` to ``tests/conftest.py`` to use
them outside ``tests/kube/``):

``kube_cluster``
    API server + kubelet + kubeconfig under the test's ``tmp_path``: a :class:`KubeCluster`.
``kube_apiserver``
    The same without a kubelet (pods stay Pending, nothing runs).

The :class:`KubeCluster` handle::

    def test_operator(kube_cluster):
        kube_cluster.kubeconfig                      # Path; also KUBECONFIG in .env()
        kube_cluster.kubectl("apply", "--validate=false", "-f", "crd.yaml")
        kube_cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", ...})   # or YAML text
        operator = kube_cluster.run_kopf(Path("operator/main.py"), namespace="default")
        watch = kube_cluster.kubectl_background("get", "gmr", "-w")
        kube_cluster.api.get("/api/v1/namespaces/default/pods")   # testbed.kube.client.KubeApi
        kube_cluster.kill("mypod")                     # SIGKILL the pod's process
        kube_cluster.kubelet.logs("default", "mypod")  # its log

Everything a test starts through the handle (kopf, background kubectl, pods' processes) is
stopped, process group and all, when the test ends, also when it fails. Outside pytest, use
``with start_cluster(workdir) as cluster:``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.kube.apiserver import ApiServer
from testbed.kube.binaries import kubectl_path
from testbed.kube.client import KubeApi
from testbed.kube.kubelet import Kubelet
from testbed.processes import ManagedProcess

__all__ = ["KubeCluster", "kube_apiserver", "kube_cluster", "start_cluster"]

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBECTL_TIMEOUT_S = 60.0


@dataclass
class KubeCluster:
    """A running emulator (and kubelet), and what a test needs to drive it."""

    server: ApiServer
    kubelet: Kubelet | None
    kubeconfig: Path
    workdir: Path
    namespace: str = "default"
    api: KubeApi = field(init=False)
    _processes: list[ManagedProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.api = KubeApi(self.server.url)

    @property
    def url(self) -> str:
        return self.server.url

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This environment plus KUBECONFIG, a private kubectl cache and the repo on
        PYTHONPATH (so ``kopf run tests/kube/...`` can import ``tests`` and ``testbed``)."""
        env = dict(os.environ)
        for key in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            env.pop(key, None)  # kopf and the kubernetes client would try in-cluster login
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.workdir / "kubectl-cache")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.update(extra or {})
        return env

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = KUBECTL_TIMEOUT_S,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl to completion; with ``check``, a non-zero exit fails with its output."""
        argv = [str(kubectl_path()), *args]
        result = subprocess.run(
            argv,
            input=input,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {result.returncode}\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def apply(self, manifest: str | Path | Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> str:
        """``kubectl apply --validate=false`` a file, YAML text, or object(s); its stdout."""
        if isinstance(manifest, Path):
            return self.kubectl("apply", "--validate=false", "-f", str(manifest)).stdout
        if isinstance(manifest, str):
            text = manifest
        elif isinstance(manifest, Mapping):
            text = json.dumps(manifest)
        else:
            text = yaml.safe_dump_all([dict(m) for m in manifest])
        return self.kubectl("apply", "--validate=false", "-f", "-", input=text).stdout

    def spawn(
        self, argv: Sequence[str], name: str, env: Mapping[str, str] | None = None
    ) -> ManagedProcess:
        """Start a process (own group, log under workdir) stopped when the cluster closes."""
        process = ManagedProcess(
            argv,
            log_path=self.workdir / "logs" / f"{name}.log",
            env=self.env(env),
            cwd=REPO_ROOT,
        )
        self._processes.append(process)
        return process

    def kubectl_background(self, *args: str, name: str = "kubectl") -> ManagedProcess:
        """A long-running kubectl (``get -w``, ``logs -f``); read it with ``.output()``."""
        return self.spawn([str(kubectl_path()), *args], name)

    def run_kopf(
        self,
        operator: Path,
        *,
        namespace: str | None = None,
        standalone: bool = True,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        name: str = "kopf",
    ) -> ManagedProcess:
        """``python -m kopf run`` the operator file, for one namespace or (None) all of them.

        ``standalone`` skips kopf's peering; without it kopf looks for KopfPeering objects,
        finds no such resource, and runs alone all the same."""
        scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
        flags = ["--standalone"] if standalone else []
        argv = [sys.executable, "-m", "kopf", "run", *flags, *scope, *args, str(operator)]
        return self.spawn(argv, name, env)

    def kill(
        self,
        pod: str,
        *,
        namespace: str | None = None,
        container: str | None = None,
        sig: int = signal.SIGKILL,
    ) -> int:
        """Signal a pod's running container process (group); returns the pid."""
        if self.kubelet is None:
            raise RuntimeError("this cluster has no kubelet")
        return self.kubelet.kill(namespace or self.namespace, pod, container, sig)

    def close(self) -> None:
        """Stop every process, then the kubelet, then the API server (each despite errors)."""
        with ExitStack() as stack:
            stack.callback(self.server.stop)
            if self.kubelet is not None:
                stack.callback(self.kubelet.stop)
            stack.callback(self.api.close)
            for process in self._processes:
                stack.callback(process.stop)


@contextmanager
def start_cluster(
    workdir: Path,
    *,
    kubelet: bool = True,
    namespace: str = "default",
    kubelet_options: Mapping[str, Any] | None = None,
    server_options: Mapping[str, Any] | None = None,
) -> Iterator[KubeCluster]:
    """An emulator (and kubelet) with state, logs and kubeconfig under ``workdir``."""
    workdir = Path(workdir)
    logs = workdir / "pod-logs"
    server = ApiServer(logs_dir=logs, **dict(server_options or {})).start()
    cluster: KubeCluster | None = None
    try:
        node: Kubelet | None = None
        if kubelet:
            # Pods that run the built-in node train its synthetic task (seconds, not the
            # language model's minute): these tests are about the operator, not the model.
            options: dict[str, Any] = {
                "extra_env": {"PYTHONPATH": str(REPO_ROOT), "GRADIENTMAIL_TASK": "synthetic"}
            }
            options.update(kubelet_options or {})
            node = Kubelet(server.url, logs_dir=logs, workdir=workdir / "pods", **options)
        cluster = KubeCluster(
            server=server,
            kubelet=node,
            kubeconfig=server.write_kubeconfig(workdir / "kubeconfig", namespace=namespace),
            workdir=workdir,
            namespace=namespace,
        )
        if node is not None:
            node.start()
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        else:
            server.stop()


@pytest.fixture
def kube_cluster(tmp_path: Path) -> Iterator[KubeCluster]:
    """An emulated API server with a kubelet running its pods as local processes."""
    with start_cluster(tmp_path / "kube") as cluster:
        yield cluster


@pytest.fixture
def kube_apiserver(tmp_path: Path) -> Iterator[KubeCluster]:
    """An emulated API server alone (``.kubelet`` is None)."""
    with start_cluster(tmp_path / "kube", kubelet=False) as cluster:
        yield cluster
