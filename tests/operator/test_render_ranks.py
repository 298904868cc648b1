"""``spec.procsPerNode``: the node pod's container runs the ranks' launcher around the
template's command (args kept, the node's environment unchanged), the CRD's schema bounds
it, and the specs whose pods could not start P ranks are refused by name."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from gradientmail_operator import render
from tests.charts import validate
from tests.operator.test_render import crd_schema, pod, spec

TEMPLATE = {"command": ["python", "/opt/train/train.py"], "args": ["--epochs", "3"]}


def test_a_node_of_two_ranks_runs_the_launcher_around_its_command() -> None:
    one, two = (pod(spec(TEMPLATE, procsPerNode=p), index=1) for p in (1, 2))
    validate.validate_all([two])  # the Kubernetes schemas, strict, oldest and newest
    container = two["spec"]["containers"][0]
    assert container["command"] == [
        *("python", "-m", "gradientmail.launch.ranks", "--procs", "2", "--"),
        *("python", "/opt/train/train.py"),
    ]
    assert container["args"] == ["--epochs", "3"]
    # The launcher gives every rank the pod's environment: the node's one learner id.
    assert container["env"] == one["spec"]["containers"][0]["env"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GRADIENTMAIL_LEARNER_ID"] == "exp-node-1"
    # procsPerNode 1 (the default) leaves the command as it was.
    assert one["spec"]["containers"][0]["command"] == TEMPLATE["command"]
    assert pod(spec(TEMPLATE))["spec"]["containers"][0]["command"] == TEMPLATE["command"]
    assert render.launch_problems(spec(TEMPLATE, procsPerNode=2)) == []


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_procs_per_node_must_be_a_count(value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        spec(TEMPLATE, procsPerNode=value)
    [error] = caught.value.errors()
    assert error["loc"] == ("procsPerNode",)
    assert "must be an int >= 1" in error["msg"]


def test_the_crd_bounds_procs_per_node() -> None:
    schema = crd_schema()
    field = schema["properties"]["spec"]["properties"]["procsPerNode"]
    assert (field["type"], field["minimum"], field["default"]) == ("integer", 1, 1)
    run: dict[str, Any] = {
        "apiVersion": "gradientmail.dev/v1alpha1",
        "kind": "GradientMailRun",
        "metadata": {"name": "exp"},
        "spec": {"nodes": 2, "mailbox": {"url": "s3://b/p"}, "procsPerNode": 2},
    }
    checker = jsonschema.Draft4Validator(schema)  # what the API server checks
    checker.validate(run)
    run["spec"]["procsPerNode"] = 0
    with pytest.raises(jsonschema.ValidationError, match="less than the minimum of 1"):
        checker.validate(run)


@pytest.mark.parametrize(
    ("gpus", "fits"),
    [
        ({"limits": {"nvidia.com/gpu": 2}}, True),
        ({"requests": {"nvidia.com/gpu": "2"}}, True),
        ({"limits": {"nvidia.com/gpu": 1}}, False),
        ({"requests": {"nvidia.com/gpu": 8}}, False),
    ],
)
def test_gpus_asked_for_match_the_ranks(gpus: dict[str, Any], fits: bool) -> None:
    template = {**TEMPLATE, "resources": gpus}
    if fits:
        pod(spec(template, procsPerNode=2))
        return
    with pytest.raises(ValidationError, match=r"nvidia\.com/gpu: \d but procsPerNode is 2"):
        spec(template, procsPerNode=2)
    spec(template)  # one process per node: the template's GPUs are its own business


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({}, "the built-in node (python -m gradientmail.demo.node) runs one process per node"),
        ({"command": [], "args": ["train.py"]}, "template.command is empty and procsPerNode is 2"),
    ],
)
def test_pods_that_cannot_start_ranks_are_refused(template: dict[str, Any], message: str) -> None:
    [problem] = render.launch_problems(spec(template, procsPerNode=2))
    assert message in problem
    assert render.launch_problems(spec(template)) == []
