"""The operator's pure parts: the CRD from one source, spec validation, pods, decisions."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from gradientmail.launch.env import NodeEnv
from gradientmail.launch.runspec import GradientMailRunSpec
from gradientmail_operator import crd, render
from gradientmail_operator.reconcile import Phase, PodState, Reason, plan

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts/gradientmail-operator/crds/gradientmailruns.yaml"


def spec(**overrides: object) -> GradientMailRunSpec:
    raw: dict[str, object] = {
        "nodes": 3,
        "mailbox": {
            "endpoint": "http://minio:9000",
            "bucket": "runs",
            "credentialsSecret": {"name": "s3"},
        },
        "algorithm": {"syncEvery": 20, "fragments": 2},
        "maxRestarts": 2,
    }
    raw.update(overrides)
    return GradientMailRunSpec.model_validate(raw)


def test_the_chart_crd_is_generated_from_the_models() -> None:
    assert CHART_CRD.read_text() == crd.render(), (
        "the CRD drifted from gradientmail/launch/runspec.py; regenerate it with "
        "`python -m gradientmail_operator.crd > charts/gradientmail-operator/crds/"
        "gradientmailruns.yaml`"
    )
    doc = yaml.safe_load(CHART_CRD.read_text())
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["gmr"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Nodes",
        "Live",
        "Round",
        "Age",
    ]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert schema["properties"]["nodes"]["minimum"] == 1
    assert "maxRestarts" in schema["properties"]
    assert "$ref" not in CHART_CRD.read_text()
    assert "anyOf" not in CHART_CRD.read_text()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nodes": 0}, "nodes"),
        ({"maxRestarts": -1}, "maxRestarts"),
        ({"barriers": {"bad/name": 2}}, "barrier name 'bad/name'"),
        ({"colour": "blue"}, "colour"),
        ({"mailbox": {"url": "ftp://x"}}, "must start with s3:// or file://"),
        ({"mailbox": {"bucket": "b", "url": "s3://b"}}, "either mailbox.url or mailbox.bucket"),
        ({"algorithm": {"syncEvery": 2, "fragments": 4}}, "cannot exceed"),
        ({"template": {"env": [{"name": "GRADIENTMAIL_NODES", "value": "9"}]}}, "set by the"),
    ],
)
def test_bad_specs_are_refused_by_name(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**overrides)


def test_pods_carry_the_contract_and_no_secrets() -> None:
    s = spec(barriers={"epoch-1": 2})
    prefix = render.run_prefix("team", "exp", "0b6f-uid")
    assert prefix == render.run_prefix("team", "exp", "0b6f-uid")
    assert prefix != render.run_prefix("team", "exp", "another-uid")
    url = render.mailbox_url(s, prefix)
    assert url == f"s3://runs/gradientmail/{prefix}?endpoint=http%3A%2F%2Fminio%3A9000"
    pod = render.pod_manifest(s, namespace="team", run="exp", uid="0b6f-uid", index=1, url=url)
    assert pod["metadata"]["name"] == "exp-node-1"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "0b6f-uid"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    container = pod["spec"]["containers"][0]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env = NodeEnv.from_environ(plain)
    assert (env.learner_id, env.node_index, env.nodes, env.mailbox) == ("exp-node-1", 1, 3, url)
    assert env.barriers == {"start": 3, "done": 3, "epoch-1": 2}
    assert (env.sync_every, env.fragments) == (20, 2)
    refs = {e["name"]: e["valueFrom"] for e in container["env"] if "valueFrom" in e}
    assert refs["AWS_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "s3", "key": "AWS_SECRET_ACCESS_KEY"}
    }


def test_a_url_mailbox_gets_the_run_prefix_appended() -> None:
    s = spec(mailbox={"url": "s3://b/base?endpoint=http://h:1"})
    assert render.mailbox_url(s, "ns/run-1") == "s3://b/base/ns/run-1?endpoint=http://h:1"


def pods(*phases: str) -> list[PodState]:
    return [PodState(f"exp-node-{i}", i, phase) for i, phase in enumerate(phases)]


def test_plan_creates_missing_pods_and_is_idempotent() -> None:
    first = plan(spec(), Phase.PENDING, 0, [])
    assert first.create == (0, 1, 2)
    second = plan(spec(), Phase.PENDING, 0, pods("Pending", "Pending", "Pending"))
    assert second.create == ()
    assert second.delete == ()
    running = plan(spec(), Phase.PENDING, 0, pods("Running", "Running", "Running"))
    assert (running.phase, running.reason) == (Phase.RUNNING, Reason.PODS_READY)


def test_plan_replaces_failed_pods_within_the_budget() -> None:
    replaced = plan(spec(), Phase.RUNNING, 1, pods("Running", "Failed", "Running"))
    assert replaced.delete == ("exp-node-1",)
    assert replaced.create == ()  # recreated on the next pass, once the old pod is gone
    assert replaced.restarts == 2
    assert [e.reason for e in replaced.events] == [Reason.POD_REPLACED]
    gone = [p for p in pods("Running", "Failed", "Running") if p.index != 1]
    assert plan(spec(), Phase.RUNNING, 2, gone).create == (1,)


def test_plan_fails_the_run_when_the_budget_is_spent() -> None:
    failed = plan(spec(), Phase.RUNNING, 2, pods("Running", "Failed", "Succeeded"))
    assert failed.phase == Phase.FAILED
    assert failed.delete == ("exp-node-0",)  # what still runs is stopped
    assert failed.events[-1].reason == Reason.RESTART_BUDGET_EXHAUSTED
    again = plan(spec(), Phase.FAILED, 2, [])
    assert (again.create, again.delete) == ((), ())  # never re-created


def test_plan_scales_and_completes() -> None:
    down = plan(spec(nodes=2), Phase.RUNNING, 0, pods("Running", "Running", "Running"))
    assert down.delete == ("exp-node-2",)
    up = plan(spec(nodes=4), Phase.RUNNING, 0, pods("Running", "Running", "Running"))
    assert up.create == (3,)
    done = plan(spec(), Phase.RUNNING, 0, pods("Succeeded", "Succeeded", "Succeeded"))
    assert done.phase == Phase.SUCCEEDED
    assert plan(spec(), Phase.SUCCEEDED, 0, []).create == ()
