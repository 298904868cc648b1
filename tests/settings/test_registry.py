"""The settings registry is the one home of every setting: the dataclasses validate with
it, the GradientMailRun spec (and so the CRD), the node environment and the CLI flags are
derived from it, and a setting the chosen algorithm does not have is refused by name."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import ValidationError

import gradientmail as gm
from gradientmail import settings
from gradientmail.algorithms import Cast, DiLoCo, Moshpit, Quantize, SparseLoCo, TopK
from gradientmail.cli._common import CliError
from gradientmail.cli.spec import FLAG_FIELDS, load_spec
from gradientmail.engine.closer import _dense_every
from gradientmail.launch.env import NodeEnv, NodeEnvError, launched_differences
from gradientmail.launch.runspec import (
    SETTING_FIELDS,
    AlgorithmSpec,
    GradientMailRunSpec,
    node_env,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "manifests" / "examples"
CRD = ROOT / "charts/gradientmail-operator/crds/gradientmailruns.yaml"
CLASSES: dict[str, Any] = {"diloco": DiLoCo, "sparseloco": SparseLoCo, "moshpit": Moshpit}
COMPRESSORS: dict[str, Any] = {"topk": TopK, "cast": Cast, "quantize": Quantize}
BOX = {"url": "file:///tmp/gradientmail-unused"}


def spec_of(algorithm: dict[str, Any], nodes: int = 4) -> GradientMailRunSpec:
    return GradientMailRunSpec.model_validate(
        {"nodes": nodes, "mailbox": BOX, "algorithm": algorithm}
    )


# -- the registry and the classes ---------------------------------------------------------


def test_the_registry_is_torch_free() -> None:
    code = (
        "import sys, gradientmail.settings, gradientmail.launch.runspec; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_each_algorithm_class_has_the_registry_fields_and_defaults(name: str) -> None:
    info = settings.algorithm_info(name)
    instance = CLASSES[name]()
    assert instance.name == name
    fields = {f.name for f in dataclasses.fields(instance)}
    for setting in info.fields:
        assert setting.name in fields
        assert getattr(instance, setting.name) == setting.default, setting.name
    for key, value in info.fixed.items():
        assert getattr(instance, key) == value
    default = getattr(instance, "compression", None)
    expected = info.default_compression
    assert (None if default is None else default.settings()) == expected
    assert settings.exchange_of(name) == ("groups" if name == "moshpit" else "rounds")


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_each_compressor_class_has_the_registry_fields_and_defaults(name: str) -> None:
    info = settings.compressor_info(name)
    instance = COMPRESSORS[name]()
    assert instance.name == name
    assert instance.settings() == {"name": name, **{s.name: s.default for s in info.fields}}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DiLoCo(sync_every=0), "DiLoCo(sync_every=0) must be an int >= 1"),
        (lambda: DiLoCo(nesterov=1), "DiLoCo(nesterov=1) must be True or False"),
        (lambda: SparseLoCo(dense_every=0), "SparseLoCo(dense_every=0) must be an int >= 1"),
        (lambda: SparseLoCo(error_decay=0), "SparseLoCo(error_decay=0) must be a number in (0, 1]"),
        (lambda: Moshpit(group_size=1), "Moshpit(group_size=1) must be an int in 2..1000"),
        (lambda: TopK(chunk=0), "TopK(chunk=0) must be an int in 1..32768"),
        (lambda: Quantize(chunk=0), "Quantize(chunk=0) must be an int >= 1"),
    ],
)
def test_a_bad_value_reads_as_the_registry_says(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()


@pytest.mark.parametrize(
    ("field", "value", "algorithm"),
    [("group_size", 1, "moshpit"), ("dense_every", 0, "sparseloco"), ("overlap", -1, "diloco")],
)
def test_one_rule_text_in_the_class_the_spec_and_the_environment(
    field: str, value: int, algorithm: str
) -> None:
    setting = (
        settings.SESSION[field][0]
        if field in settings.SESSION
        else settings.algorithm_info(algorithm).field(field)
    )
    rule = f"must be {setting.rule()}"
    with pytest.raises(ValidationError) as spec_error:
        spec_of({"name": algorithm, settings.camel(field): value})
    assert spec_error.value.errors()[0]["loc"] == ("algorithm", settings.camel(field))
    assert rule in spec_error.value.errors()[0]["msg"]
    with pytest.raises(NodeEnvError, match=f"GRADIENTMAIL_{field.upper()}={value} {rule}"):
        NodeEnv(mailbox="file:///x", learner_id="n0", algorithm=algorithm, **{field: value})
    if field not in settings.SESSION:
        with pytest.raises(ValueError, match=rf"\({field}={value}\) {rule}"):
            CLASSES[algorithm](**{field: value})


def test_dense_every_is_a_declared_capability() -> None:
    assert settings.algorithm_info("sparseloco").dense_every
    assert not settings.algorithm_info("diloco").dense_every
    assert _dense_every(SparseLoCo(dense_every=4)) == 4
    assert _dense_every(DiLoCo()) == 1
    assert settings.dense_every({"name": "diloco", "dense_every": 4}) == 1  # not DiLoCo's


# -- derived: the spec (CRD), the flags, the environment ----------------------------------


def test_the_spec_and_the_flags_cover_every_setting_of_the_registry() -> None:
    described = {s.name for info in settings.ALGORITHMS.values() for s in info.fields}
    described |= set(settings.SESSION) | set(settings.NODE)
    assert described == set(SETTING_FIELDS)
    assert set(AlgorithmSpec.model_fields) == {"name", "compression", "lm", *SETTING_FIELDS}
    assert {"algorithm", "compression", "lm", *SETTING_FIELDS} <= set(FLAG_FIELDS)
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    algo = schema["properties"]["spec"]["properties"]["algorithm"]["properties"]
    assert algo["name"]["enum"] == list(settings.ALGORITHMS)[:3]
    assert algo["compression"]["properties"]["name"]["enum"] == list(settings.COMPRESSORS)
    assert (algo["groupSize"]["minimum"], algo["groupSize"]["maximum"]) == (2, 1000)


@pytest.mark.parametrize(
    ("algorithm", "field"),
    [
        ({"name": "moshpit", "compression": {"name": "topk"}}, "compression"),
        ({"name": "moshpit", "overlap": 2}, "overlap"),
        ({"name": "moshpit", "mixing": 0.5}, "mixing"),
        ({"name": "diloco", "denseEvery": 4}, "denseEvery"),
        ({"name": "diloco", "errorDecay": 0.5}, "errorDecay"),
        ({"name": "sparseloco", "outerMomentum": 0.5}, "outerMomentum"),
        ({"name": "sparseloco", "nesterov": False}, "nesterov"),
        ({"name": "sparseloco", "groupSize": 8}, "groupSize"),
    ],
)
def test_a_setting_the_algorithm_does_not_have_is_refused_by_name(
    algorithm: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        spec_of(algorithm)
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [("algorithm", field)], errors
    assert f"this run is {settings.algorithm_info(algorithm['name']).title}" in errors[0]["msg"]


def test_a_compressor_field_of_another_compressor_is_refused_by_name() -> None:
    with pytest.raises(ValidationError) as caught:
        spec_of({"compression": {"name": "cast", "bits": 8}})
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [("algorithm", "compression", "bits")]
    assert "not a setting of Cast" in errors[0]["msg"]


ROUND_TRIPS = [
    (
        ["--algorithm", "sparseloco", "--dense-every", "4", "--error-decay", "0.9"],
        SparseLoCo(sync_every=25, fragments=2, dense_every=4, error_decay=0.9),
    ),
    (
        ["--compression", "topk:density=0.05,bits=4", "--outer-lr", "0.5", "--nesterov", "false"],
        DiLoCo(
            sync_every=25,
            fragments=2,
            outer_lr=0.5,
            nesterov=False,
            compression=TopK(density=0.05, bits=4),
        ),
    ),
    (
        ["--compression", "cast:dtype=float16", "--buffers", "closer"],
        DiLoCo(sync_every=25, fragments=2, buffers="closer", compression=Cast("float16")),
    ),
    (
        ["--compression", "quantize:bits=4"],
        DiLoCo(sync_every=25, fragments=2, compression=Quantize(bits=4)),
    ),
    (
        ["--algorithm", "moshpit", "--group-size", "3", "--grid-dims", "1"],
        Moshpit(sync_every=25, group_size=3, grid_dims=1),
    ),
]


@pytest.mark.parametrize(("argv", "expected"), ROUND_TRIPS)
def test_flags_run_yaml_environment_node_env_algorithm_round_trip(
    argv: list[str], expected: Any, tmp_path: Path
) -> None:
    from gradientmail.cli import _parser

    extra = ["--task", "synthetic"]
    if expected.name != "moshpit":
        extra += ["--overlap", "1", "--keep-rounds", "3"]
    args = _parser().parse_args(["run", *argv, *extra])
    loaded = load_spec(None, vars(args), default_mailbox="file:///tmp/box")
    # run.yaml, read back by `gradientmail run -f` (and the operator's model)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(loaded.resource))
    again = load_spec(path, {}, default_mailbox="file:///tmp/box")
    assert again.spec == loaded.spec
    env = node_env(again.spec, "exp", 0, "file:///tmp/box")
    wire = env.to_environ()
    assert wire["GRADIENTMAIL_TASK"] == "synthetic"
    back = NodeEnv.from_environ(wire)
    assert back == env
    assert back.build_algorithm() == expected
    options = back.session_options()
    if expected.name != "moshpit":
        assert (options["overlap"], options["keep_rounds"]) == (1, 3)
    else:
        assert "overlap" not in options
    # what `gradientmail run` shows is what the nodes build
    assert f"syncEvery {expected.sync_every}" in loaded.spec.algorithm.describe()
    assert launched_differences("exp-node-0", expected.settings(), wire) == []


def test_a_session_whose_algorithm_differs_from_the_launch_is_refused_naming_both() -> None:
    wire = NodeEnv(mailbox="file:///x", learner_id="exp-node-0", sync_every=25).to_environ()
    found = launched_differences("exp-node-0", DiLoCo(sync_every=20).settings(), wire)
    assert found == [
        "algorithm sync_every: the run has 25 (GRADIENTMAIL_SYNC_EVERY), this node has 20"
    ]
    assert launched_differences("someone-else", DiLoCo(sync_every=20).settings(), wire) == []


def test_a_launched_session_with_another_algorithm_is_refused_at_join(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    wire = NodeEnv(mailbox="file:///x", learner_id="exp-node-0", sync_every=25).to_environ()
    for key, value in wire.items():
        monkeypatch.setenv(key, value)
    model = torch.nn.Linear(2, 2)
    box = gm.MemoryMailbox()
    with pytest.raises(
        gm.ProtocolError,
        match=r"sync_every: the run has 25 \(GRADIENTMAIL_SYNC_EVERY\), this node has 20",
    ):
        gm.Session(model, algorithm=DiLoCo(sync_every=20), mailbox=box, learner_id="exp-node-0")
    assert not asyncio.run(box.list("")), "refused before anything is written"
    with NodeEnv.from_environ().session(model, mailbox=box) as session:
        assert session.algorithm == DiLoCo(sync_every=25)


def test_a_bad_compression_flag_is_named() -> None:
    with pytest.raises(CliError, match="--compression: compression 'zip' is unknown"):
        load_spec(None, {"compression": "zip"}, default_mailbox="file:///tmp/box")
    with pytest.raises(CliError, match=r"--compression: TopK\(bits=3\) must be 2, 4 or 8"):
        load_spec(None, {"compression": "topk:bits=3"}, default_mailbox="file:///tmp/box")


def test_the_operator_takes_the_node_task_from_the_spec_or_the_template() -> None:
    spec = spec_of({"task": "synthetic"})
    assert node_env(spec, "r", 0, "file:///x").to_environ()["GRADIENTMAIL_TASK"] == "synthetic"
    templated = GradientMailRunSpec.model_validate(
        {
            "nodes": 1,
            "mailbox": BOX,
            "template": {"env": [{"name": "GRADIENTMAIL_TASK", "value": "lm"}]},
        }
    )
    assert templated.template.env[0].name == "GRADIENTMAIL_TASK"
    with pytest.raises(ValidationError, match="give one of them"):
        GradientMailRunSpec.model_validate(
            {
                "nodes": 1,
                "mailbox": BOX,
                "algorithm": {"task": "synthetic"},
                "template": {"env": [{"name": "GRADIENTMAIL_TASK", "value": "lm"}]},
            }
        )


# -- the example manifests: one per algorithm ---------------------------------------------


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("gradientmailrun*.yaml")))
def test_each_example_run_is_valid_for_the_crd_and_the_operator(name: str) -> None:
    run = yaml.safe_load((EXAMPLES / name).read_text())
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(run)
    spec = GradientMailRunSpec.model_validate(run["spec"])
    node_env(spec, "example", 0, "file:///x").build_algorithm()  # what every pod runs


def test_there_is_an_example_run_for_each_algorithm() -> None:
    names = set()
    for path in EXAMPLES.glob("gradientmailrun*.yaml"):
        names.add(
            GradientMailRunSpec.model_validate(
                yaml.safe_load(path.read_text())["spec"]
            ).algorithm.name
        )
    assert names == {"diloco", "sparseloco", "moshpit"}
