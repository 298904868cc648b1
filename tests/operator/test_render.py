"""The node pod template: every field rendered and valid for Kubernetes, the restricted
defaults and their replacement, the file:// rule for clusters, names too long for labels,
and the example of manifests/examples/script-from-configmap.yaml."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from gradientmail.launch.env import NodeEnv
from gradientmail.launch.runspec import GradientMailRunSpec, learner_id
from gradientmail.wire import check_learner_id
from gradientmail_operator import render
from tests.charts import validate

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts/gradientmail-operator/crds/gradientmailruns.yaml"
EXAMPLE = ROOT / "manifests/examples/script-from-configmap.yaml"

LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

S3 = {"endpoint": "http://minio:9000", "bucket": "runs", "credentialsSecret": {"name": "s3"}}


def spec(template: dict[str, Any] | None = None, **overrides: Any) -> GradientMailRunSpec:
    raw: dict[str, Any] = {"nodes": 2, "mailbox": S3}
    if template is not None:
        raw["template"] = template
    raw.update(overrides)
    return GradientMailRunSpec.model_validate(raw)


def pod(s: GradientMailRunSpec, run: str = "exp", index: int = 0) -> dict[str, Any]:
    return render.pod_manifest(
        s, namespace="team", run=run, uid="0b6f-uid", index=index, url="s3://runs/p"
    )


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CHART_CRD.read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


FULL_TEMPLATE: dict[str, Any] = {
    "image": "registry.example/team/trainer:1.2",
    "imagePullPolicy": "IfNotPresent",
    "imagePullSecrets": [{"name": "regcred"}],
    "command": ["python", "/opt/train/train.py"],
    "args": ["--epochs", "3"],
    "workingDir": "/opt/train",
    "env": [
        {"name": "DATA_DIR", "value": "/data"},
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
    ],
    "envFrom": [{"configMapRef": {"name": "train-settings"}}, {"secretRef": {"name": "wandb"}}],
    "resources": {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": 1},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 1},
    },
    "volumes": [
        {"name": "script", "configMap": {"name": "train-script", "defaultMode": 0o444}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "data", "readOnly": True}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}},
    ],
    "volumeMounts": [
        {"name": "script", "mountPath": "/opt/train", "readOnly": True},
        {"name": "data", "mountPath": "/data", "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
    ],
    "nodeSelector": {"nvidia.com/gpu.present": "true"},
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"gradientmail.dev/run": "exp"}},
                    },
                }
            ]
        }
    },
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "training",
    "runtimeClassName": "nvidia",
    "serviceAccountName": "trainer",
    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["IPC_LOCK"]}},
    "podSecurityContext": {"runAsUser": 0, "fsGroup": 2000},
    "labels": {"team": "vision"},
    "annotations": {"example.com/owner": "vision"},
}


def test_the_full_template_renders_a_valid_pod() -> None:
    s = spec(FULL_TEMPLATE)
    jsonschema.Draft4Validator(crd_schema()).validate(
        {
            "apiVersion": "gradientmail.dev/v1alpha1",
            "kind": "GradientMailRun",
            "spec": {"nodes": 2, "mailbox": S3, "template": FULL_TEMPLATE},
        }
    )
    manifest = pod(s, index=1)
    validate.validate_all([manifest])  # the Kubernetes schemas, strict, oldest and newest
    body = manifest["spec"]
    container = body["containers"][0]
    assert container["image"] == "registry.example/team/trainer:1.2"
    assert container["workingDir"] == "/opt/train"
    assert container["envFrom"] == FULL_TEMPLATE["envFrom"]
    assert container["volumeMounts"] == FULL_TEMPLATE["volumeMounts"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["securityContext"] == FULL_TEMPLATE["securityContext"]
    assert body["securityContext"] == {"runAsUser": 0, "fsGroup": 2000}
    assert body["volumes"] == FULL_TEMPLATE["volumes"]
    assert body["imagePullSecrets"] == [{"name": "regcred"}]
    assert body["affinity"] == FULL_TEMPLATE["affinity"]
    assert body["tolerations"] == FULL_TEMPLATE["tolerations"]
    assert body["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert (body["priorityClassName"], body["runtimeClassName"]) == ("training", "nvidia")
    assert body["serviceAccountName"] == "trainer"
    names = [e["name"] for e in container["env"]]
    assert names[-2:] == ["DATA_DIR", "HF_TOKEN"]  # after the contract and the credentials
    assert "GRADIENTMAIL_MAILBOX" in names
    assert "AWS_ACCESS_KEY_ID" in names
    meta = manifest["metadata"]
    assert meta["labels"]["team"] == "vision"
    assert meta["labels"][render.LABEL_RUN] == "exp"
    assert meta["annotations"] == {"example.com/owner": "vision", render.ANNOTATION_RUN_NAME: "exp"}
    # The rendered pod does not share objects with the spec (the handler may mutate it).
    container["volumeMounts"][0]["readOnly"] = False
    assert s.template.volume_mounts is not None
    assert s.template.volume_mounts[0]["readOnly"] is True


def test_a_minimal_spec_keeps_the_restricted_defaults() -> None:
    manifest = pod(spec())
    validate.validate_all([manifest])
    body = manifest["spec"]
    container = body["containers"][0]
    assert body["securityContext"] == render.RESTRICTED_POD_SECURITY
    assert container["securityContext"] == render.RESTRICTED_CONTAINER_SECURITY
    assert body["automountServiceAccountToken"] is False
    assert body["restartPolicy"] == "Never"
    for absent in (
        "volumes",
        "imagePullSecrets",
        "affinity",
        "nodeSelector",
        "tolerations",
        "priorityClassName",
        "runtimeClassName",
        "serviceAccountName",
    ):
        assert absent not in body
    for absent in ("volumeMounts", "envFrom", "workingDir", "resources", "imagePullPolicy"):
        assert absent not in container
    assert manifest["metadata"]["name"] == "exp-node-0"
    assert manifest["metadata"]["annotations"] == {render.ANNOTATION_RUN_NAME: "exp"}
    # Defaults are copies: rendering cannot change the module's constants.
    container["securityContext"]["capabilities"]["drop"].append("X")
    assert render.RESTRICTED_CONTAINER_SECURITY["capabilities"] == {"drop": ["ALL"]}


def test_a_given_security_context_replaces_the_default_whole() -> None:
    relaxed = pod(spec({"securityContext": {"privileged": True}, "podSecurityContext": {}}))
    validate.validate_all([relaxed])
    assert relaxed["spec"]["containers"][0]["securityContext"] == {"privileged": True}
    assert relaxed["spec"]["securityContext"] == {}
    only_pod = pod(spec({"podSecurityContext": {"runAsUser": 0, "runAsNonRoot": False}}))
    assert only_pod["spec"]["securityContext"] == {"runAsUser": 0, "runAsNonRoot": False}
    assert (
        only_pod["spec"]["containers"][0]["securityContext"] == render.RESTRICTED_CONTAINER_SECURITY
    )


def test_the_owner_reference_does_not_block_owner_deletion() -> None:
    ref = pod(spec())["metadata"]["ownerReferences"]
    assert ref == [
        {
            "apiVersion": "gradientmail.dev/v1alpha1",
            "kind": "GradientMailRun",
            "name": "exp",
            "uid": "0b6f-uid",
            "controller": True,
        }
    ]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({"volumes": [{"emptyDir": {}}]}, r"template.volumes\[0\] has no name"),
        (
            {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]},
            "'a' is used twice",
        ),
        (
            {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"mountPath": "/a"}]},
            r"volumeMounts\[0\] has no name",
        ),
        (
            {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a"}]},
            r"volumeMounts\[0\] \('a'\) needs an absolute mountPath",
        ),
        (
            {
                "volumes": [{"name": "data", "emptyDir": {}}],
                "volumeMounts": [{"name": "dta", "mountPath": "/data"}],
            },
            r"the mount 'dta' at /data names no volume in template.volumes \(declared: data\)",
        ),
        (
            {"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
            "the mount 'data' at /data names no volume",
        ),
        ({"imagePullSecrets": [{}]}, "imagePullSecrets"),
        ({"envFrom": ["configMapRef"]}, "envFrom"),
        ({"env": [{"name": "GRADIENTMAIL_STEPS", "value": "9"}]}, "set by the operator"),
        ({"hostNetwork": True}, "hostNetwork"),  # unknown fields are still refused by name
    ],
)
def test_bad_templates_are_refused_by_name(template: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(template)


def test_poll_status_defaults_to_true() -> None:
    assert spec().mailbox.poll_status is True
    off = spec(mailbox={**S3, "pollStatus": False})
    assert off.mailbox.poll_status is False
    schema = crd_schema()["properties"]["spec"]["properties"]["mailbox"]["properties"]
    assert schema["pollStatus"] == {
        "default": True,
        "description": schema["pollStatus"]["description"],
        "type": "boolean",
    }


def test_free_form_objects_preserve_unknown_fields_in_the_crd() -> None:
    template = crd_schema()["properties"]["spec"]["properties"]["template"]["properties"]
    for name in ("affinity", "securityContext", "podSecurityContext"):
        assert template[name]["x-kubernetes-preserve-unknown-fields"] is True, name
        assert template[name]["type"] == "object"
    for name in ("volumes", "volumeMounts", "envFrom"):
        assert template[name]["items"] == {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
        }, name
    assert template["resources"]["properties"]["limits"]["additionalProperties"] == {
        "x-kubernetes-int-or-string": True
    }


# -- file:// mailboxes on a cluster ---------------------------------------------------------


def file_spec(url: str = "file:///shared/runs", **template: Any) -> GradientMailRunSpec:
    return spec(template, mailbox={"url": url})


CLAIM = {"name": "box", "persistentVolumeClaim": {"claimName": "gm-rwx"}}


def test_s3_mailboxes_have_no_cluster_problems() -> None:
    assert render.cluster_problems(spec()) == []
    assert render.cluster_problems(spec(mailbox={"url": "s3://b/base?endpoint=http://h:1"})) == []


def test_a_file_mailbox_without_a_volume_is_refused() -> None:
    [problem] = render.cluster_problems(file_spec())
    assert "mailbox.url 'file:///shared/runs': no volume is mounted at or above" in problem
    assert "persistentVolumeClaim" in problem
    assert "ReadWriteMany" in problem
    assert "each pod starts its own one-node run" in problem
    # Still a valid spec: `gradientmail run` runs it as local processes.
    assert file_spec().mailbox.url == "file:///shared/runs"


def test_a_file_mailbox_on_a_shared_claim_is_accepted() -> None:
    mounted = file_spec(volumes=[CLAIM], volumeMounts=[{"name": "box", "mountPath": "/shared"}])
    assert render.cluster_problems(mounted) == []
    exact = file_spec(volumes=[CLAIM], volumeMounts=[{"name": "box", "mountPath": "/shared/runs/"}])
    assert render.cluster_problems(exact) == []
    validate.validate_all([pod(mounted)])


@pytest.mark.parametrize(
    ("url", "volumes", "mounts", "message"),
    [
        (  # an emptyDir is per pod
            "file:///shared/runs",
            [{"name": "box", "emptyDir": {}}],
            [{"name": "box", "mountPath": "/shared"}],
            "lies on the volume mount 'box' at /shared, whose volume is not a "
            "persistentVolumeClaim",
        ),
        (  # a sibling path is not under the mount
            "file:///shared-runs",
            [CLAIM],
            [{"name": "box", "mountPath": "/shared"}],
            "no volume is mounted at or above /shared-runs",
        ),
        (  # `..` leaves the mount
            "file:///shared/../etc/runs",
            [CLAIM],
            [{"name": "box", "mountPath": "/shared"}],
            "no volume is mounted at or above /etc/runs",
        ),
        (  # the deepest mount decides
            "file:///shared/tmp/runs",
            [CLAIM, {"name": "tmp", "emptyDir": {}}],
            [{"name": "box", "mountPath": "/shared"}, {"name": "tmp", "mountPath": "/shared/tmp"}],
            "mount 'tmp' at /shared/tmp, whose volume is not a persistentVolumeClaim",
        ),
        (
            "file:///shared/runs",
            [CLAIM],
            [{"name": "box", "mountPath": "/shared", "readOnly": True}],
            "which is read-only",
        ),
        ("file://host/shared/runs", [CLAIM], [], "does not name an absolute directory"),
    ],
)
def test_file_mailboxes_off_a_shared_claim_are_refused(
    url: str, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]], message: str
) -> None:
    s = file_spec(url, volumes=volumes, volumeMounts=mounts)
    problems = render.cluster_problems(s)
    assert len(problems) == 1
    assert message in problems[0]


# -- names too long for labels --------------------------------------------------------------


def test_short_names_are_unchanged() -> None:
    assert render.run_label("exp") == "exp"
    assert render.run_label("a" * 63) == "a" * 63
    assert render.pod_name("exp", 3) == "exp-node-3"
    assert learner_id("exp", 3) == "exp-node-3"
    assert learner_id("my.run", 0) == "my.run-node-0"


@pytest.mark.parametrize(
    "name",
    [
        "a" * 64,
        "train-" + "x" * 100 + ".v2",
        ("long-run-name." * 20)[:240] + "z",
        "-".join(["seg"] * 63) + "-a",  # 253 characters, cut at a dash
        "b" * 253,
    ],
)
def test_long_names_get_valid_labels_pod_names_and_learner_ids(name: str) -> None:
    assert len(name) <= 253
    assert DNS_SUBDOMAIN.fullmatch(name)
    label = render.run_label(name)
    assert len(label) <= 63
    assert LABEL_VALUE.fullmatch(label), label
    assert label == render.run_label(name)  # stable
    assert label != render.run_label(name[:-1] + ("c" if name[-1] != "c" else "d"))
    nodes = 1000
    manifest = pod(spec(nodes=nodes), run=name, index=nodes - 1)
    assert manifest["metadata"]["labels"][render.LABEL_RUN] == label
    assert manifest["metadata"]["annotations"][render.ANNOTATION_RUN_NAME] == name
    assert manifest["metadata"]["ownerReferences"][0]["name"] == name
    validate.validate_all([manifest])
    names = {render.pod_name(name, i) for i in (0, 1, 10, 999)}
    assert len(names) == 4
    for pod_name in names:
        assert len(pod_name) <= 253
        assert DNS_SUBDOMAIN.fullmatch(pod_name), pod_name
    ids = {learner_id(name, i) for i in (0, 1, 10, 100, 999)}
    assert len(ids) == 5
    for learner in ids:
        check_learner_id(learner)
    env = {e["name"]: e.get("value") for e in manifest["spec"]["containers"][0]["env"]}
    assert NodeEnv.from_environ(
        {k: v for k, v in env.items() if v is not None}
    ).learner_id == learner_id(name, nodes - 1)


def test_long_names_of_different_runs_stay_apart() -> None:
    base = "r" * 200
    a, b = base + "-one", base + "-two"
    assert render.run_label(a) != render.run_label(b)
    assert render.pod_name(a + "x" * 45, 0) != render.pod_name(b + "x" * 45, 0)
    assert learner_id(a, 0) != learner_id(b, 0)


# -- the example: a script from a ConfigMap, data from a PVC --------------------------------


def test_the_script_example_is_valid_and_renders_valid_pods() -> None:
    docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ConfigMap", "PersistentVolumeClaim", "GradientMailRun"}
    validate.validate_all([by_kind["ConfigMap"], by_kind["PersistentVolumeClaim"]])
    run = by_kind["GradientMailRun"]
    jsonschema.Draft4Validator(crd_schema()).validate(run)  # what the API server checks
    s = GradientMailRunSpec.model_validate(run["spec"])  # what the operator checks
    assert render.cluster_problems(s) == []
    # The template mounts the script's ConfigMap and the data claim, and runs the script.
    volumes = {v["name"]: v for v in s.template.volumes or []}
    config = by_kind["ConfigMap"]
    claim = by_kind["PersistentVolumeClaim"]
    assert {v.get("configMap", {}).get("name") for v in volumes.values()} >= {
        config["metadata"]["name"]
    }
    assert {v.get("persistentVolumeClaim", {}).get("claimName") for v in volumes.values()} >= {
        claim["metadata"]["name"]
    }
    script = next(
        f"{m['mountPath']}/{name}"
        for m in s.template.volume_mounts or []
        if "configMap" in volumes[m["name"]]
        for name in config["data"]
    )
    assert script in s.template.command + s.template.args
    for name, text in config["data"].items():
        if name.endswith(".py"):
            compile(ast.parse(text), name, "exec")
            assert "NodeEnv.from_environ()" in text
            assert "env.session(" in text
    url = render.mailbox_url(s, render.run_prefix("default", run["metadata"]["name"], "uid"))
    pods = [
        render.pod_manifest(
            s, namespace="default", run=run["metadata"]["name"], uid="uid", index=i, url=url
        )
        for i in range(s.nodes)
    ]
    validate.validate_all(pods)
