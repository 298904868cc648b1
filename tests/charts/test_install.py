"""The chart installed with the real helm into the Kubernetes stand-in, its operator
Deployment run by the local kubelet, and the example run trained to Succeeded.

What the stand-in lacks, and what these tests do about it (``testbed/kube/__init__.py``):

- no Deployment controller: the test creates the operator pod from the installed
  Deployment's pod template, unchanged (command, args, env, probes' port);
- no ServiceAccount token mount: the kubelet gives every pod ``KUBECONFIG`` instead
  (kopf and the kubernetes client fall back to it when the in-cluster token is absent);
- no probes: the test asks kopf's liveness endpoint itself, on the port the chart set;
- no RBAC enforcement: the API server records every request, and each request the operator
  made must be allowed by the Roles helm installed (and be listed in
  ``gradientmail_operator.kube``).

The mailbox is SeaweedFS when ``GRADIENTMAIL_S3_ENDPOINT`` names it (as under CI), else a
directory (``file://``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testbed.audit import AuditingApiServer
from testbed.kube import fixtures
from testbed.kube.fixtures import KubeCluster, start_cluster
from testbed.rbac import ANY_NAMESPACE, CLUSTER_SCOPED, Rbac, Request, required
from testbed.s3env import S3Target, ensure_bucket
from tests.charts import helm
from tests.charts.helm import CHART, NAMESPACE, RELEASE, ROOT
from tests.conftest import S3_TARGETS
from tests.support.waiting import TEST_TIMEOUT, wait_until

EXAMPLES = ROOT / "manifests" / "examples"
RUN_TIMEOUT = max(TEST_TIMEOUT, 30) * 8  # a whole training run on a loaded 2-core machine
RBAC_API = "/apis/rbac.authorization.k8s.io/v1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeCluster]:
    """The stand-in with an auditing API server and a kubelet whose pods find the API
    through ``KUBECONFIG`` (a real kubelet mounts a ServiceAccount token instead), and whose
    node pods train the built-in node's synthetic task, as ``start_cluster``'s own do (these
    tests are about the chart and the operator, not the language model: the example run's
    model trained for minutes here)."""
    monkeypatch.setattr(fixtures, "ApiServer", AuditingApiServer)
    workdir = tmp_path / "kube"
    env = {
        "PYTHONPATH": str(ROOT),
        "KUBECONFIG": str(workdir / "kubeconfig"),
        "GRADIENTMAIL_TASK": "synthetic",
    }
    with start_cluster(workdir, kubelet_options={"extra_env": env}) as running:
        yield running


def _helm(cluster: KubeCluster, *args: str) -> str:
    return helm.helm(*args, env=cluster.env()).stdout


def _install(cluster: KubeCluster, values: dict[str, Any], *extra: str) -> str:
    if _target() is None:  # a file mailbox: the stand-in's pods share this machine's disk
        operator = dict(values.get("operator") or {})
        values = {**values, "operator": {**operator, "fileMailboxes": "shared"}}
    args, temp = helm.values_args(values)
    try:
        return _helm(
            cluster, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace",
            *args, *extra,
        )  # fmt: skip
    finally:
        if temp is not None:
            temp.unlink()


def _start_operator(cluster: KubeCluster) -> dict[str, Any]:
    """What the Deployment controller would do: a pod from the Deployment's template."""
    deployment = cluster.api.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}")
    template = deployment["spec"]["template"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{RELEASE}-standin",
            "namespace": NAMESPACE,
            "labels": dict(template["metadata"].get("labels") or {}),
            "annotations": dict(template["metadata"].get("annotations") or {}),
        },
        "spec": template["spec"],
    }
    return cluster.api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod)


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _scrape(port: int) -> str | None:
    try:
        response = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    except requests.RequestException:
        return None
    return response.text if response.status_code == 200 else None


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` in a scrape, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def _target() -> S3Target | None:
    preferred = [t for t in S3_TARGETS if t.name == "seaweedfs"] or S3_TARGETS
    return preferred[0] if preferred else None


def _example(cluster: KubeCluster, tmp_path: Path, namespace: str, **spec: Any) -> str:
    """Apply manifests/examples/ (the Secret and the run) into ``namespace``, the mailbox
    pointed at this machine's store; returns the run's name."""
    secret = yaml.safe_load((EXAMPLES / "s3-credentials.yaml").read_text())
    run = yaml.safe_load((EXAMPLES / "gradientmailrun.yaml").read_text())
    target = _target()
    mailbox = run["spec"]["mailbox"]
    if target is None:
        run["spec"]["mailbox"] = {"url": (tmp_path / "mailbox").as_uri()}
    else:
        ensure_bucket(target)
        secret["stringData"] = {
            "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
        }
        mailbox.update(endpoint=target.endpoint_url, bucket=target.bucket)
    run["spec"].update(spec)
    for doc in (secret, run):
        doc["metadata"]["namespace"] = namespace
        cluster.apply(doc)
    return str(run["metadata"]["name"])


def _status(cluster: KubeCluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "gmr", name, "-n", namespace, "-o", "json").stdout
    return dict(json.loads(out).get("status") or {})


def _pods(cluster: KubeCluster, namespace: str, run: str) -> list[dict[str, Any]]:
    listing = cluster.api.get(
        f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"gradientmail.dev/run={run}"
    )
    return list(listing["items"])


def _without_age(table: str) -> list[list[str]]:
    return [line.split()[:-1] for line in table.splitlines()]


def _installed_rbac(cluster: KubeCluster) -> list[dict[str, Any]]:
    docs = []
    for kind, plural in (
        ("ClusterRole", "clusterroles"),
        ("ClusterRoleBinding", "clusterrolebindings"),
        ("Role", "roles"),
        ("RoleBinding", "rolebindings"),
    ):
        for item in cluster.api.get(f"{RBAC_API}/{plural}")["items"]:
            docs.append({**item, "kind": kind})
    return docs


def _check_audit(cluster: KubeCluster, watch: list[str]) -> set[Request]:
    """Every request the operator made is allowed by the installed RBAC and declared in
    gradientmail_operator.kube; returns them."""
    server = cluster.server
    assert isinstance(server, AuditingApiServer)
    used = server.operator_requests()
    account = cluster.api.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts")["items"]
    assert [a["metadata"]["name"] for a in account] == [RELEASE]
    rbac = Rbac(_installed_rbac(cluster), NAMESPACE, RELEASE)
    denied = sorted(str(r) for r in used if not rbac.allows(r))
    assert not denied, f"the operator made requests its installed RBAC does not allow: {denied}"
    declared = required(watch)
    normalized = set()
    for r in used:
        namespace = r.namespace
        if not watch and (r.group, r.resource) not in CLUSTER_SCOPED:
            namespace = ANY_NAMESPACE  # one namespace, or all of them (kopf's watches)
        normalized.add(Request(r.verb, r.group, r.resource, namespace))
    undeclared = sorted(str(r) for r in normalized - declared)
    assert not undeclared, f"requests missing from gradientmail_operator.kube: {undeclared}"
    return used


def test_the_chart_installs_and_the_example_run_succeeds(
    cluster: KubeCluster, tmp_path: Path
) -> None:
    port, metrics_port = _free_port(), _free_port()
    notes = _install(
        cluster,
        {
            "operator": {"healthPort": port, "statusInterval": 1, "reconcileInterval": 1},
            "metrics": {"port": metrics_port},
        },
    )
    assert "STATUS: deployed" in notes
    assert "kubectl get gmr -w" in notes
    assert "CRD was not found" not in notes  # helm's lookup found the CRD it installed
    assert cluster.api.exists(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gradientmailruns.gradientmail.dev"
    )
    _start_operator(cluster)
    wait_until(lambda: _healthy(port), f"kopf's liveness endpoint on :{port}", timeout=60)
    name = _example(cluster, tmp_path, "default")
    seen: list[str] = []

    def succeeded() -> dict[str, Any] | None:
        table = cluster.kubectl("get", "gmr", "-n", "default").stdout
        if not seen or _without_age(seen[-1]) != _without_age(table):
            seen.append(table)
        status = _status(cluster, "default", name)
        assert status.get("phase") not in ("Failed", "Invalid"), status
        return status if status.get("phase") == "Succeeded" else None

    final = wait_until(succeeded, "the example run to succeed", timeout=RUN_TIMEOUT, every=0.5)
    print("\n".join(seen))
    assert final["roundsCommitted"] >= 1
    assert final["nodes"]["succeeded"] == 2
    # The operator's metrics endpoint, on the port the chart gave it, shows the run.
    labels = {"namespace": "default", "run": name}

    def scraped() -> str | None:
        text = _scrape(metrics_port)
        if (
            text is None
            or _sample(text, "gradientmail_run_phase", **labels, phase="Succeeded") != 1
        ):
            return None
        return text

    text = wait_until(
        scraped,
        f"the operator's metrics on :{metrics_port} to show the run Succeeded (handlers.py "
        "serves them: metrics.serve(metrics.port_from_env()), metrics.observe_run(...))",
        timeout=60,
        every=0.5,
    )
    assert (_sample(text, "gradientmail_run_rounds_committed", **labels) or 0) >= 1
    assert "gradientmail_operator_mailbox_polls_total" in text
    pods = _pods(cluster, "default", name)
    assert {p["spec"]["containers"][0]["image"] for p in pods} == {
        "ghcr.io/gradientmail/node:0.1.0"  # the chart's nodePods.image, via the operator
    }
    used = _check_audit(cluster, [])
    print("the operator's requests:", *sorted(map(str, used)), sep="\n  ")
    for expected in (
        Request("watch", "gradientmail.dev", "gradientmailruns", None),
        Request("create", "", "pods", "default"),
        Request("patch", "gradientmail.dev", "gradientmailruns/status", "default"),
        Request("create", "", "events", "default"),
    ):
        assert expected in used, f"the audit missed {expected}: {sorted(map(str, used))}"


def test_a_namespaced_install_serves_only_its_namespaces(
    cluster: KubeCluster, tmp_path: Path
) -> None:
    cluster.kubectl("create", "namespace", "team-a")
    port = _free_port()
    _install(
        cluster,
        {
            "watchNamespaces": ["team-a"],
            "operator": {"healthPort": port, "statusInterval": 1, "reconcileInterval": 1},
            "metrics": {"port": _free_port()},
        },
    )
    _start_operator(cluster)
    wait_until(lambda: _healthy(port), f"kopf's liveness endpoint on :{port}", timeout=60)
    quick = {"nodes": 1, "algorithm": {"syncEvery": 5, "fragments": 1, "steps": 15}}
    served = _example(cluster, tmp_path / "a", "team-a", **quick)
    ignored = _example(cluster, tmp_path / "b", "default", **quick)
    wait_until(
        lambda: _status(cluster, "team-a", served).get("phase") == "Succeeded",
        "the run in team-a to succeed",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    assert _status(cluster, "default", ignored) == {}
    assert _pods(cluster, "default", ignored) == []
    used = _check_audit(cluster, ["team-a"])
    assert {r.namespace for r in used} == {"team-a"}, "a request outside team-a"


def test_skip_crds_upgrade_and_uninstall(kube_apiserver: KubeCluster) -> None:
    cluster = kube_apiserver
    crd_path = (
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/gradientmailruns.gradientmail.dev"
    )
    notes = _install(cluster, {}, "--skip-crds")
    assert not cluster.api.exists(crd_path)
    assert "CRD was not found" in notes
    cluster.apply(CHART / "crds" / "gradientmailruns.yaml")
    deployment = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{RELEASE}"
    assert (
        "--debug"
        not in cluster.api.get(deployment)["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    out = _helm(
        cluster, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--set", "operator.logLevel=debug"
    )
    assert "REVISION: 2" in out
    args = cluster.api.get(deployment)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--debug" in args
    _helm(cluster, "uninstall", RELEASE, "-n", NAMESPACE)
    assert not cluster.api.exists(deployment)
    assert not cluster.api.exists(f"{RBAC_API}/clusterroles/{RELEASE}")
    assert not cluster.api.exists(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{RELEASE}")
    assert cluster.api.exists(crd_path), "helm uninstall keeps the CRD (and so the runs)"
