"""A real ``kopf run`` of the sample operator: custom resource → pods run by the kubelet →
status patched as they finish → printer columns in ``kubectl get`` follow; delete runs the
operator's finalizer and garbage collection takes the pods (and their processes) away."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testbed.kube.fixtures import KubeCluster
from testbed.processes import ManagedProcess, pid_alive
from tests.kube.sample_operator import FINALIZER, LABEL
from tests.support.waiting import wait_until

HERE = Path(__file__).parent
JOBS = "/apis/demo.gradientmail.dev/v1/namespaces/default/samplejobs"
PODS = "/api/v1/namespaces/default/pods"

# Each pod waits for a file named after it in $GATE, so the test decides when each finishes.
GATED = (
    "import os, pathlib, sys, time\n"
    "gate = pathlib.Path(os.environ['GATE']) / os.environ['HOSTNAME']\n"
    "deadline = time.monotonic() + 120\n"
    "while not gate.exists() and time.monotonic() < deadline:\n"
    "    time.sleep(0.05)\n"
    "print('pod', os.environ['SAMPLEJOB_INDEX'], 'released', flush=True)\n"
    "sys.exit(int(gate.read_text() or 0) if gate.exists() else 1)\n"
)


def columns(cluster: KubeCluster, name: str, namespace: str = "default") -> dict[str, str]:
    """``kubectl get sj NAME`` as header → cell."""
    output = cluster.kubectl("get", "sj", name, "-n", namespace).stdout
    header, *lines = output.strip().splitlines()
    keys = re.split(r"\s{2,}", header.strip())
    values = re.split(r"\s{2,}", lines[0].strip())
    return dict(zip(keys, values, strict=False))


@pytest.fixture
def operator(kube_cluster: KubeCluster) -> ManagedProcess:
    kube_cluster.apply(HERE / "sample_crd.yaml")
    process = kube_cluster.run_kopf(HERE / "sample_operator.py", namespace="default")
    return process


def test_operator_pods_and_printer_columns_end_to_end(
    kube_cluster: KubeCluster, operator: ManagedProcess, tmp_path: Path
) -> None:
    cluster, api = kube_cluster, kube_cluster.api
    gate = tmp_path / "gate"
    gate.mkdir()
    watch = cluster.kubectl_background("get", "sj", "-w", name="get-w")
    assert "samplejob.demo.gradientmail.dev/job created" in cluster.apply(
        sample_job_yaml("job", 3, gate)
    )

    def pods_running() -> bool:
        pods = api.get(PODS, labelSelector=f"{LABEL}=job")["items"]
        return len(pods) == 3 and all(p["status"]["phase"] == "Running" for p in pods)

    wait_until(pods_running, "the operator's 3 pods to run")
    wait_until(lambda: columns(cluster, "job").get("RUNNING") == "3", "RUNNING 3")
    job = api.get(f"{JOBS}/job")
    assert FINALIZER in job["metadata"]["finalizers"]
    for pod in api.get(PODS, labelSelector=f"{LABEL}=job")["items"]:
        (owner,) = pod["metadata"]["ownerReferences"]
        assert owner["uid"] == job["metadata"]["uid"]
        assert owner["controller"] is True

    for done in ("1", "2", "3"):
        (gate / f"job-{int(done) - 1}").write_text("0")
        wait_until(lambda: columns(cluster, "job").get("SUCCEEDED") == done, f"SUCCEEDED {done}")  # noqa: B023
    final = columns(cluster, "job")
    assert (final["PHASE"], final["PODS"], final["RUNNING"], final["SUCCEEDED"]) == (
        "Succeeded",
        "3",
        "0",
        "3",
    )
    assert api.get(f"{PODS}/job-1/log") == "pod 1 released\n"

    # kubectl get -w saw the columns change as the pods finished.
    wait_until(lambda: "Succeeded" in watch.output(), "get -w to show Succeeded")
    watch.stop()
    succeeded_column = [
        re.split(r"\s{2,}", line.strip())[4]
        for line in watch.output().splitlines()
        if line.startswith("job ") and len(re.split(r"\s{2,}", line.strip())) == 6
    ]
    assert [n for i, n in enumerate(succeeded_column) if i == 0 or succeeded_column[i - 1] != n][
        -4:
    ] == ["0", "1", "2", "3"]

    described = cluster.kubectl("describe", "sj", "job").stdout
    assert re.search(r"Normal\s+PodsCreated\s+.*created 3 pods", described)
    assert re.search(r"Normal\s+Succeeded\s+.*3/3 pods succeeded", described)

    # Deletion: kopf's finalizer runs the delete handler, then GC removes the pods.
    cluster.kubectl("delete", "sj", "job", "--timeout=30s")
    assert not api.exists(f"{JOBS}/job")
    assert api.get("/api/v1/namespaces/default/configmaps/job-deleted")["data"] == {
        "samplejob": "job"
    }
    wait_until(
        lambda: not api.get(PODS, labelSelector=f"{LABEL}=job")["items"], "the pods to be collected"
    )
    assert operator.exit_status() is None, operator.output()
    assert "Traceback" not in operator.output()


def test_cluster_wide_a_killed_pod_fails_the_job_and_namespace_deletion_cleans_up(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    cluster, api = kube_cluster, kube_cluster.api
    assert cluster.kubelet is not None
    cluster.apply(HERE / "sample_crd.yaml")
    operator = cluster.run_kopf(HERE / "sample_operator.py", standalone=False)  # all namespaces
    cluster.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    gate = tmp_path / "gate"
    gate.mkdir()
    cluster.apply(sample_job_yaml("crashy", 2, gate, namespace="team"))
    wait_until(
        lambda: columns(cluster, "crashy", "team").get("RUNNING") == "2", "RUNNING 2 in team"
    )
    survivor = cluster.kubelet.pid("team", "crashy-1")
    assert survivor is not None
    cluster.kill("crashy-0", namespace="team")  # as an OOM kill would
    wait_until(lambda: columns(cluster, "crashy", "team").get("PHASE") == "Failed", "Failed")
    killed = api.get("/api/v1/namespaces/team/pods/crashy-0")["status"]["containerStatuses"]
    assert killed[0]["state"]["terminated"]["exitCode"] == 137
    # Deleting the namespace deletes the job (kopf's finalizer runs first) and the pods.
    cluster.kubectl("delete", "namespace", "team", "--timeout=30s")
    assert not api.exists("/api/v1/namespaces/team")
    assert not pid_alive(survivor)
    assert operator.exit_status() is None, operator.output()
    assert "Handler 'delete' succeeded" in operator.output()


def sample_job_yaml(name: str, pods: int, gate: Path, namespace: str = "default") -> str:
    manifest = {
        "apiVersion": "demo.gradientmail.dev/v1",
        "kind": "SampleJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "pods": pods,
            "command": ["python", "-c", GATED],
            "env": [{"name": "GATE", "value": str(gate)}],
        },
    }
    return json.dumps(manifest)  # JSON is YAML
