"""The chart with the real helm: lint, render every documented value combination, validate
each rendered document against the Kubernetes schemas, and refuse bad values."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml

from tests.charts import docs, helm, validate
from tests.charts.helm import CHART, CI_VALUES, NAMESPACE, RELEASE, find, one

COMBINATIONS = dict(helm.combinations())


def _container(docs_: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = find(docs_, "Deployment", None)
    operator = [
        d
        for d in deployment
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "operator"
    ]
    assert len(operator) == 1
    containers = operator[0]["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_helm_lint_passes_for_the_defaults_and_every_values_file() -> None:
    assert "0 chart(s) failed" in helm.lint()
    files = sorted(CI_VALUES.glob("*-values.yaml"))
    assert len(files) >= 4
    for path in files:
        assert "0 chart(s) failed" in helm.lint(files=[path]), path.name


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_combination_renders_valid_kubernetes_documents(name: str) -> None:
    docs_ = helm.template(COMBINATIONS[name], include_crds=True)
    validate.validate_all(docs_)
    kinds = [d["kind"] for d in docs_]
    assert kinds.count("CustomResourceDefinition") == 1
    values = COMBINATIONS[name]
    watched = values.get("watchNamespaces") or []
    rbac = (values.get("rbac") or {}).get("create", True)
    if rbac and watched:
        assert not find(docs_, "ClusterRole")
        assert not find(docs_, "ClusterRoleBinding")
        assert sorted({r["metadata"]["namespace"] for r in find(docs_, "Role")}) == sorted(
            set(watched)
        )
    elif rbac:
        assert len(find(docs_, "ClusterRole")) == 1
        assert not find(docs_, "Role")
    else:
        assert not {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"} & set(kinds)
    sa = (values.get("serviceAccount") or {}).get("create", True)
    assert ("ServiceAccount" in kinds) == sa
    minio = (values.get("minio") or {}).get("enabled", False)
    assert ("Job" in kinds) == minio
    metrics = {"enabled": True, **(values.get("metrics") or {})}
    services = [s["metadata"]["name"] for s in find(docs_, "Service")]
    assert any(s.endswith("-metrics") for s in services) == metrics["enabled"]
    monitor = (metrics.get("serviceMonitor") or {}).get("enabled", False)
    assert ("ServiceMonitor" in kinds) == (metrics["enabled"] and monitor)
    dashboard = (metrics.get("dashboard") or {}).get("enabled", False)
    assert bool(find(docs_, "ConfigMap")) == dashboard
    for doc in docs_:
        if doc["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace"), f"{doc['kind']} without a namespace"


def test_the_validator_catches_a_typo() -> None:
    docs_ = helm.template()
    deployment = one(docs_, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(AssertionError, match="readinesProbe"):
        validate.validate_all([deployment])


def test_crds_are_installed_unless_skipped() -> None:
    crds = [d for d in helm.template(include_crds=True) if d["kind"] == "CustomResourceDefinition"]
    assert [c["metadata"]["name"] for c in crds] == ["gradientmailruns.gradientmail.dev"]
    assert crds[0] == yaml.safe_load((CHART / "crds" / "gradientmailruns.yaml").read_text())
    assert not find(helm.template(), "CustomResourceDefinition")  # --skip-crds / no --include


def test_the_operator_deployment() -> None:
    docs_ = helm.template()
    deployment = one(docs_, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    container = _container(docs_)
    assert container["image"] == "ghcr.io/gradientmail/operator:0.1.0"
    assert container["command"] == ["kopf", "run"]
    assert container["args"] == [
        "--module=gradientmail_operator.handlers",
        "--standalone",
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--log-format=full",
    ]
    env = _env(container)
    assert env["GRADIENTMAIL_OPERATOR_STATUS_INTERVAL"] == "10"
    assert env["GRADIENTMAIL_OPERATOR_RECONCILE_INTERVAL"] == "60"
    assert env["GRADIENTMAIL_OPERATOR_POLL_BUDGET"] == "30"
    assert env["GRADIENTMAIL_OPERATOR_RESTART_BACKOFF"] == "10,300"
    assert env["GRADIENTMAIL_OPERATOR_NODE_IMAGE"] == "ghcr.io/gradientmail/node:0.1.0"
    assert env["GRADIENTMAIL_OPERATOR_METRICS_PORT"] == "8081"
    assert "GRADIENTMAIL_OPERATOR_POD_LABELS" not in env
    assert "GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_POLICY" not in env  # Kubernetes's default
    assert "GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_SECRETS" not in env
    assert "GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING" not in env
    assert env["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [
        {"name": "health", "containerPort": 8080, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8081, "protocol": "TCP"},
    ]
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]["memory"]
    # The restricted Pod Security Standard, and a read-only root.
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["serviceAccountName"] == one(docs_, "ServiceAccount")["metadata"]["name"]
    selector = spec["selector"]["matchLabels"]
    assert selector.items() <= spec["template"]["metadata"]["labels"].items()


def test_values_reach_the_operator() -> None:
    values = yaml.safe_load((CI_VALUES / "customized-values.yaml").read_text())
    docs_ = helm.template(values)
    container = _container(docs_)
    assert container["image"] == (
        "registry.example.com/ml/gradientmail-operator@sha256:" + "0123456789abcdef" * 4
    )
    assert container["imagePullPolicy"] == "Always"
    assert "--log-format=json" in container["args"]
    assert "--quiet" in container["args"]
    assert "--liveness=http://0.0.0.0:9090/healthz" in container["args"]
    assert container["ports"][0]["containerPort"] == 9090
    env = _env(container)
    assert env["GRADIENTMAIL_OPERATOR_STATUS_INTERVAL"] == "30"
    assert env["GRADIENTMAIL_OPERATOR_RECONCILE_INTERVAL"] == "5"
    assert env["GRADIENTMAIL_OPERATOR_NODE_IMAGE"] == "registry.example.com/ml/trainer:2025.06"
    # The operator parses k=v,k2=v2 (handlers.POD_LABELS): sorted by key here.
    assert env["GRADIENTMAIL_OPERATOR_POD_LABELS"] == (
        "cost-center.example.com/id=4711,team=ml-research"
    )
    assert env["AWS_DEFAULT_REGION"] == "eu-central-1"
    # The node pods' pull settings, for the operator to put on the pods it creates.
    assert env["GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_POLICY"] == "Always"
    assert env["GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_SECRETS"] == "regcred,ml-registry"
    assert env["GRADIENTMAIL_OPERATOR_METRICS_PORT"] == "9091"
    assert {"name": "metrics", "containerPort": 9091, "protocol": "TCP"} in container["ports"]
    service = find(docs_, "Service", "gm-operator-metrics")[0]
    assert service["metadata"]["annotations"] == {"example.com/scrape-team": "ml-platform"}
    assert service["spec"]["ports"][0]["port"] == 9091
    deployment = one(docs_, "Deployment")
    pod = deployment["spec"]["template"]
    assert deployment["metadata"]["name"] == "gm-operator"
    assert pod["metadata"]["labels"]["team"] == "ml-platform"
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "false"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["spec"]["serviceAccountName"] == "gm-operator-sa"
    account = one(docs_, "ServiceAccount")
    assert account["metadata"]["name"] == "gm-operator-sa"
    assert "eks.amazonaws.com/role-arn" in account["metadata"]["annotations"]
    assert one(docs_, "ClusterRoleBinding")["subjects"] == [
        {"kind": "ServiceAccount", "name": "gm-operator-sa", "namespace": NAMESPACE}
    ]


@pytest.mark.parametrize(
    ("level", "flags"), [("info", []), ("debug", ["--debug"]), ("warning", ["--quiet"])]
)
def test_log_levels_map_to_kopf_flags(level: str, flags: list[str]) -> None:
    args = _container(helm.template({"operator": {"logLevel": level}}))["args"]
    assert [a for a in args if a in ("--debug", "--quiet", "--verbose")] == flags


def test_namespaced_mode_watches_only_the_named_namespaces() -> None:
    docs_ = helm.template({"watchNamespaces": ["team-a", "team-b", "team-a"]})
    container = _container(docs_)
    assert "--all-namespaces" not in container["args"]
    assert [a for a in container["args"] if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    assert _env(container)["GRADIENTMAIL_OPERATOR_CLUSTER_SCANNING"] == "0"
    for binding in find(docs_, "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_the_dev_minio_is_off_by_default_and_self_consistent() -> None:
    defaults = helm.template()
    assert not find(defaults, "Service", "minio")
    assert not find(defaults, "Deployment", "minio")
    docs_ = helm.template({"minio": {"enabled": True}})
    secret = find(docs_, "Secret", "minio-root")[0]
    service = find(docs_, "Service", "minio")[0]
    minio = find(docs_, "Deployment", "minio")[0]
    job = one(docs_, "Job")
    labels = minio["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert {p["port"] for p in service["spec"]["ports"]} == {9000, 9001}
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-1] == "local/runs"
    host = next(e["value"] for e in container["env"] if e["name"] == "MC_HOST_local")
    assert host.endswith(f"@minio.{NAMESPACE}:9000")
    assert secret["stringData"]["MINIO_ROOT_USER"] == "gradientmail"
    # The example Secret holds the same credentials as the dev MinIO.
    example = yaml.safe_load((helm.ROOT / "manifests/examples/s3-credentials.yaml").read_text())
    assert example["stringData"] == {
        "AWS_ACCESS_KEY_ID": secret["stringData"]["MINIO_ROOT_USER"],
        "AWS_SECRET_ACCESS_KEY": secret["stringData"]["MINIO_ROOT_PASSWORD"],
    }
    for pod_spec in (minio["spec"]["template"]["spec"], job["spec"]["template"]["spec"]):
        assert pod_spec["securityContext"]["runAsNonRoot"] is True
        for c in pod_spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"operator": {"logLevel": "loud"}}, "/operator/logLevel"),
        ({"operator": {"logFormat": "xml"}}, "/operator/logFormat"),
        ({"operator": {"statusInterval": 0}}, "/operator/statusInterval"),
        ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
        ({"watchNamespaces": "team-a"}, "/watchNamespaces"),
        ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
        ({"replicaCount": 2}, "replicaCount"),
        ({"nodePods": {"labels": {"team": "a,b"}}}, "/nodePods/labels/team"),
        ({"nodePods": {"labels": {"a=b": "c"}}}, "invalid propertyName 'a=b'"),
        ({"image": {"digest": "latest"}}, "/image/digest"),
        ({"minio": {"rootPassword": "short"}}, "/minio/rootPassword"),
        ({"minio": {"enabled": "yes"}}, "/minio/enabled"),
        ({"livenessProbe": {"periodSecond": 5}}, "periodSecond"),
        ({"nodePods": {"image": {"pullPolicy": "Sometimes"}}}, "/nodePods/image/pullPolicy"),
        ({"nodePods": {"imagePullSecrets": [{"secret": "x"}]}}, "/nodePods/imagePullSecrets/0"),
        ({"nodePods": {"imagePullSecrets": "regcred"}}, "/nodePods/imagePullSecrets"),
        ({"metrics": {"port": 80}}, "/metrics/port"),
        ({"metrics": {"enabled": "yes"}}, "/metrics/enabled"),
        ({"metrics": {"serviceMonitor": {"interval": "30 seconds"}}}, "interval"),
        ({"metrics": {"serviceMonitor": {"intervall": "30s"}}}, "intervall"),
        ({"metrics": {"dashboard": {"namespace": "Grafana"}}}, "/metrics/dashboard/namespace"),
    ],
)
def test_the_schema_refuses_bad_values(values: dict[str, Any], complaint: str) -> None:
    result = helm.template_text(values, check=False)
    assert result.returncode != 0
    assert "schema" in result.stderr, result.stderr
    assert complaint in result.stderr, result.stderr


def test_an_existing_service_account_must_be_named() -> None:
    result = helm.template_text({"serviceAccount": {"create": False}}, check=False)
    assert result.returncode != 0
    assert "serviceAccount.name is required" in result.stderr


def test_the_schema_and_the_values_agree() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) == set(schema["properties"]) - {"global"}
    for key, value in values.items():
        node = schema["properties"][key]
        if isinstance(value, dict) and node.get("additionalProperties") is False:
            assert set(value) <= set(node["properties"]), key


def test_every_value_is_documented_and_the_readme_table_is_current() -> None:
    text = docs.VALUES.read_text()
    values = yaml.safe_load(text)
    keys = {d.path for d in docs.documented(text)}
    undocumented = [
        ".".join(leaf)
        for leaf in docs.leaves(values)
        if not any(leaf[:i] in keys for i in range(1, len(leaf) + 1))
    ]
    assert not undocumented, f"values without a `# --` comment: {undocumented}"
    assert docs.README.read_text() == docs.readme(), (
        "the chart README's values table drifted: run `python -m tests.charts.docs`"
    )


def test_notes_tell_the_next_command() -> None:
    notes = _notes({})
    assert "kubectl get gmr -w" in notes
    assert "rollout status" in notes
    assert "s3-credentials" in notes


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["name"] == RELEASE
    assert chart["apiVersion"] == "v2"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    # The node image the chart defaults to is the one the spec models default to.
    from gradientmail.launch.runspec import DEFAULT_IMAGE

    assert f"ghcr.io/gradientmail/node:{chart['appVersion']}" == DEFAULT_IMAGE


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"operator": {"logLevel": "debug", "logFormat": "json"}},
        {"operator": {"logLevel": "warning", "logFormat": "plain"}},
        {"watchNamespaces": ["team-a", "team-b"], "operator": {"healthPort": 9090}},
    ],
    ids=["defaults", "debug-json", "warning-plain", "namespaced"],
)
def test_kopf_accepts_the_rendered_command_line(values: dict[str, Any], tmp_path: Any) -> None:
    """The rendered command and args parse with this kopf (the module is swapped for one that
    does not exist, so it stops right after parsing)."""
    container = _container(helm.template(values))
    args = [
        "--module=gradientmail_no_such_module" if a.startswith("--module=") else a
        for a in container["args"]
    ]
    assert container["command"] == ["kopf", "run"]
    result = subprocess.run(
        [sys.executable, "-m", "kopf", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        check=False,
    )
    assert "No module named 'gradientmail_no_such_module'" in result.stderr, result.stderr


# -- metrics, the ServiceMonitor and the dashboard ----------------------------------------------


def _metrics_service(docs_: list[dict[str, Any]]) -> dict[str, Any]:
    return find(docs_, "Service", f"{RELEASE}-metrics")[0]


def test_the_metrics_service_targets_the_operators_metrics_port() -> None:
    docs_ = helm.template()
    service = _metrics_service(docs_)
    assert service["metadata"]["namespace"] == NAMESPACE
    assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "metrics"
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod = one(docs_, "Deployment")["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
    assert ports == {"health": 8080, "metrics": 8081}
    from gradientmail_operator import metrics

    assert _env(_container(docs_))["GRADIENTMAIL_OPERATOR_METRICS_PORT"] == "8081"
    assert metrics.ENV_PORT == "GRADIENTMAIL_OPERATOR_METRICS_PORT"
    assert metrics.DEFAULT_PORT == 8081  # the chart's default and the operator's agree


def test_metrics_disabled_means_no_port_no_service_and_the_operator_told() -> None:
    docs_ = helm.template({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})
    validate.validate_all(docs_)
    assert not find(docs_, "Service")
    assert not find(docs_, "ServiceMonitor")
    container = _container(docs_)
    assert [p["name"] for p in container["ports"]] == ["health"]
    assert _env(container)["GRADIENTMAIL_OPERATOR_METRICS_PORT"] == "0"  # 0: off


def test_the_metrics_port_must_differ_from_the_health_port() -> None:
    result = helm.template_text({"metrics": {"port": 8080}}, check=False)
    assert result.returncode != 0
    assert "metrics.port and operator.healthPort are both 8080" in result.stderr
    # Disabled, the clash does not matter.
    helm.template({"metrics": {"enabled": False, "port": 8080}})


def test_the_service_monitor_only_when_enabled() -> None:
    assert not find(helm.template(), "ServiceMonitor")
    values = {
        "metrics": {
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "scrapeTimeout": "10s",
                "labels": {"release": "kube-prometheus-stack"},
            }
        }
    }
    docs_ = helm.template(values)
    validate.validate_all(docs_)  # the ServiceMonitor against validate.SERVICE_MONITOR
    monitor = one(docs_, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    service = _metrics_service(docs_)
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    # It selects the metrics Service only, not the dev MinIO's or another component's.
    assert selector["app.kubernetes.io/component"] == "metrics"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {
            "port": service["spec"]["ports"][0]["name"],
            "path": "/metrics",
            "interval": "15s",
            "scrapeTimeout": "10s",
            "honorLabels": True,  # the runs' namespace label, not the operator's
        }
    ]
    defaults = one(
        helm.template({"metrics": {"serviceMonitor": {"enabled": True}}}), "ServiceMonitor"
    )
    assert defaults["spec"]["endpoints"][0]["interval"] == "30s"
    assert "scrapeTimeout" not in defaults["spec"]["endpoints"][0]


def test_the_validator_catches_a_service_monitor_typo() -> None:
    docs_ = helm.template({"metrics": {"serviceMonitor": {"enabled": True}}})
    monitor = one(docs_, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(AssertionError, match="intervall"):
        validate.validate_all([monitor])


def _dashboard_metric_names(dashboard: dict[str, Any]) -> set[str]:
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    names = set()
    for expr in exprs:
        names |= set(re.findall(r"\b(gradientmail_[a-z_]+)", expr))
    return names


def test_the_dashboard_config_map_holds_the_dashboard() -> None:
    assert not find(helm.template(), "ConfigMap")
    docs_ = helm.template({"metrics": {"dashboard": {"enabled": True, "namespace": "monitoring"}}})
    validate.validate_all(docs_)
    config_map = one(docs_, "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["gradientmail.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "gradientmail.json").read_text())
    assert dashboard["uid"] == "gradientmail-runs"
    assert dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    # Every metric the dashboard queries is one the operator exports.
    from gradientmail_operator import metrics

    metrics.observe_run("dash", "board", {"phase": "Running", "lastCommitAgeSeconds": 1.0})
    metrics.poll_done("dash", "board", "ok", 0.1)
    metrics.reconciled()
    try:
        exported = set(re.findall(r"^# TYPE (\S+) (\w+)$", metrics.exposition().decode(), re.M))
    finally:
        metrics.forget_run("dash", "board")
    names = {n for n, _ in exported}
    names |= {f"{n}_total" for n, kind in exported if kind == "counter"}
    names |= {f"{n}_{s}" for n, k in exported if k == "histogram" for s in ("bucket", "count")}
    queried = _dashboard_metric_names(dashboard)
    assert "gradientmail_run_rounds_committed" in queried
    assert queried <= names, f"the dashboard queries unknown metrics: {sorted(queried - names)}"


# -- images, tags and pull settings --------------------------------------------------------------


def test_image_tags_default_to_the_app_version() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    container = _container(helm.template())
    assert container["image"] == f"ghcr.io/gradientmail/operator:{app_version}"
    assert _env(container)["GRADIENTMAIL_OPERATOR_NODE_IMAGE"] == (
        f"ghcr.io/gradientmail/node:{app_version}"
    )
    # An explicit tag wins, for each image on its own.
    container = _container(
        helm.template({"image": {"tag": "1.2.3"}, "nodePods": {"image": {"tag": "4.5.6"}}})
    )
    assert container["image"] == "ghcr.io/gradientmail/operator:1.2.3"
    assert _env(container)["GRADIENTMAIL_OPERATOR_NODE_IMAGE"] == "ghcr.io/gradientmail/node:4.5.6"


@pytest.mark.parametrize("policy", ["Always", "IfNotPresent", "Never"])
def test_the_node_pull_policy_and_secrets_reach_the_operator(policy: str) -> None:
    values = {
        "nodePods": {
            "image": {"pullPolicy": policy},
            "imagePullSecrets": [{"name": "regcred"}, {"name": "other"}, {"name": "regcred"}],
        }
    }
    assert "0 chart(s) failed" in helm.lint(values)
    docs_ = helm.template(values)
    validate.validate_all(docs_)
    env = _env(_container(docs_))
    assert env["GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_POLICY"] == policy
    assert env["GRADIENTMAIL_OPERATOR_NODE_IMAGE_PULL_SECRETS"] == "regcred,other"
    # The operator's own pod pulls with its own secrets, not the node pods'.
    pod = one(docs_, "Deployment")["spec"]["template"]["spec"]
    assert "imagePullSecrets" not in pod


# -- NOTES.txt ----------------------------------------------------------------------------------


def _notes(values: dict[str, Any]) -> str:
    args, temp = helm.values_args(values)
    try:
        out = helm.helm(
            "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args
        ).stdout
    finally:
        if temp is not None:
            temp.unlink()
    return out.split("NOTES:", 1)[1]


def _kubectl_lines(notes: str, *words: str) -> list[str]:
    return [
        line.strip()
        for line in notes.splitlines()
        if line.strip().startswith("kubectl") and all(w in line for w in words)
    ]


def test_notes_name_a_served_namespace_when_namespaced() -> None:
    notes = _notes({"watchNamespaces": ["team-b", "team-a", "team-b"]})
    assert "serving GradientMailRuns in: team-b, team-a." in notes
    for words in (("create secret",), ("apply -f -",), ("get gmr -w",), ("describe gmr",)):
        lines = _kubectl_lines(notes, *words)
        assert lines, words
        assert all(line.startswith("kubectl -n team-b ") for line in lines), lines
    # Cluster-wide: any namespace will do, so no -n.
    notes = _notes({})
    assert _kubectl_lines(notes, "create secret") == [
        "kubectl create secret generic s3-credentials \\"
    ]
    assert _kubectl_lines(notes, "get gmr -w") == ["kubectl get gmr -w"]


def test_notes_show_the_metrics_endpoint() -> None:
    notes = _notes({})
    assert f"port-forward service/{RELEASE}-metrics 8081" in notes
    assert "/metrics" not in _notes({"metrics": {"enabled": False}})
