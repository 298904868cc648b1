"""Moshpit from the launch side: one line of the GradientMailRun spec (``algorithm: {name:
moshpit}``) or ``gradientmail run --algorithm moshpit`` picks it; the node environment
carries it to every node, whose Session then runs group rounds; the CRD and the operator's
pods carry it too."""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.algorithms import moshpit
from gradientmail.cli._common import CliError
from gradientmail.cli.spec import load_spec
from gradientmail.launch import env as launch_env
from gradientmail.launch.env import NodeEnv, NodeEnvError
from gradientmail.launch.runspec import AlgorithmSpec, GradientMailRunSpec, node_env
from gradientmail.mailbox.url import open_mailbox
from gradientmail_operator import crd, render
from tests.cli.test_cli import cli

ROOT = Path(__file__).resolve().parents[2]
CHART_CRD = ROOT / "charts/gradientmail-operator/crds/gradientmailruns.yaml"
BOX = {"url": "file:///tmp/gradientmail-unused"}


def spec_of(algorithm: dict[str, object], nodes: int = 16) -> GradientMailRunSpec:
    return GradientMailRunSpec.model_validate(
        {"nodes": nodes, "mailbox": BOX, "algorithm": algorithm}
    )


# -- the spec -------------------------------------------------------------------------------


def test_one_line_picks_moshpit_with_a_4_by_4_grid() -> None:
    algo = spec_of({"name": "moshpit"}).algorithm
    assert (algo.name, algo.group_size, algo.grid_dims) == ("moshpit", 4, 2)
    assert algo.fragments == 1
    assert spec_of({}).algorithm.name == "diloco"  # no name: DiLoCo, as before
    custom = spec_of({"name": "moshpit", "groupSize": 8, "gridDims": 3, "syncEvery": 50})
    assert (custom.algorithm.group_size, custom.algorithm.grid_dims) == (8, 3)
    assert custom.algorithm.sync_every == 50


@pytest.mark.parametrize(
    ("algorithm", "field", "message"),
    [
        ({"name": "moshpit", "fragments": 2}, "fragments", "a DiLoCo/SparseLoCo setting"),
        ({"name": "moshpit", "outerLr": 0.5}, "outerLr", "a DiLoCo/SparseLoCo setting"),
        ({"name": "moshpit", "outerMomentum": 0.5}, "outerMomentum", "a DiLoCo setting"),
        ({"name": "moshpit", "quorum": 2}, "quorum", "a DiLoCo/SparseLoCo setting"),
        ({"groupSize": 8}, "groupSize", "a Moshpit setting"),
        ({"name": "diloco", "gridDims": 3}, "gridDims", "a Moshpit setting"),
        ({"name": "moshpit", "groupSize": 1}, "groupSize", "must be an int in 2..1000"),
        ({"name": "moshpit", "groupSize": 1001}, "groupSize", "must be an int in 2..1000"),
        ({"name": "moshpit", "gridDims": 0}, "gridDims", "must be an int in 1..8"),
        ({"name": "moshpit", "gridDims": 9}, "gridDims", "must be an int in 1..8"),
        ({"name": "sgd"}, "name", "'diloco', 'sparseloco' or 'moshpit'"),
    ],
)
def test_settings_of_the_other_algorithm_and_bad_values_are_refused_by_name(
    algorithm: dict[str, object], field: str, message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        spec_of(algorithm)
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [("algorithm", field)], errors
    assert message in errors[0]["msg"]


def test_a_moshpit_spec_with_every_default_written_out_is_accepted() -> None:
    # The API server writes the CRD's defaults (fragments: 1, outerLr: 0.7, ...) into every
    # resource; run.yaml round-trips through model_dump too.
    spec = spec_of({"name": "moshpit", "groupSize": 3})
    again = GradientMailRunSpec.model_validate(spec.model_dump(by_alias=True, mode="json"))
    assert again == spec
    explicit = {"name": "moshpit", "fragments": 1, "outerLr": 0.7, "quorum": 1}
    assert spec_of(explicit).algorithm.name == "moshpit"


def test_the_launch_bounds_are_the_algorithms_own() -> None:
    assert launch_env.MAX_GROUP_SIZE == moshpit.MAX_GROUP_SIZE
    assert launch_env.MAX_GRID_DIMS == moshpit.MAX_GRID_DIMS
    literal = AlgorithmSpec.model_fields["name"].annotation
    assert typing.get_args(literal) == launch_env.ALGORITHMS
    defaults = gm.Moshpit()
    algo = AlgorithmSpec(name="moshpit")
    assert (algo.group_size, algo.grid_dims) == (defaults.group_size, defaults.grid_dims)


# -- the node environment -------------------------------------------------------------------


def test_the_environment_carries_moshpit_and_round_trips() -> None:
    spec = spec_of({"name": "moshpit", "groupSize": 2, "gridDims": 3, "syncEvery": 7}, nodes=8)
    env = node_env(spec, "exp", 5, "file:///tmp/box")
    wire = env.to_environ()
    assert wire["GRADIENTMAIL_ALGORITHM"] == "moshpit"
    assert (wire["GRADIENTMAIL_GROUP_SIZE"], wire["GRADIENTMAIL_GRID_DIMS"]) == ("2", "3")
    assert NodeEnv.from_environ(wire) == env
    algorithm = env.build_algorithm()
    assert algorithm == gm.Moshpit(sync_every=7, group_size=2, grid_dims=3)


def test_an_environment_without_the_algorithm_means_diloco() -> None:
    wire = NodeEnv(mailbox="file:///tmp/x", learner_id="n0", sync_every=9).to_environ()
    for name in ("ALGORITHM", "GROUP_SIZE", "GRID_DIMS"):
        del wire[f"GRADIENTMAIL_{name}"]  # a launcher from before Moshpit
    env = NodeEnv.from_environ(wire)
    assert env.algorithm == "diloco"
    assert env.build_algorithm() == gm.DiLoCo(sync_every=9)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"GRADIENTMAIL_ALGORITHM": "sgd"}, "GRADIENTMAIL_ALGORITHM='sgd'"),
        ({"GRADIENTMAIL_GROUP_SIZE": "1"}, "GRADIENTMAIL_GROUP_SIZE=1 must be an int in 2..1000"),
        ({"GRADIENTMAIL_GRID_DIMS": "9"}, "GRADIENTMAIL_GRID_DIMS=9 must be an int in 1..8"),
        ({"GRADIENTMAIL_GRID_DIMS": "two"}, "GRADIENTMAIL_GRID_DIMS='two' is not a int"),
    ],
)
def test_a_bad_algorithm_variable_is_named(change: dict[str, str], message: str) -> None:
    wire = NodeEnv(mailbox="file:///tmp/x", learner_id="n0").to_environ() | change
    with pytest.raises(NodeEnvError, match=message):
        NodeEnv.from_environ(wire)


@pytest.mark.parametrize("store", ["memory", "file"])
def test_env_session_runs_moshpit(store: str, tmp_path: Path) -> None:
    box: gm.Mailbox = gm.MemoryMailbox() if store == "memory" else gm.FileMailbox(tmp_path)
    env = NodeEnv(
        mailbox="file:///unused",
        learner_id="exp-node-0",
        algorithm="moshpit",
        sync_every=2,
        group_size=2,
        grid_dims=1,
        round_timeout=0.5,
    )
    model = torch.nn.Linear(3, 2)
    with env.session(model, mailbox=box, poll_interval=0.05) as session:
        assert session.algorithm == gm.Moshpit(sync_every=2, group_size=2, grid_dims=1)
        for _ in range(4):  # two group rounds, alone in its group: closed at round_timeout
            session.step(samples=1)

    async def keys(prefix: str) -> list[str]:
        return list(await box.list(prefix))

    assert asyncio.run(keys(p.GRID)) == [p.grid_key(0)]  # its slot on the grid
    assert asyncio.run(keys(p.ROUNDS)) == [p.round_key(0)]  # the initial commit only
    groups = asyncio.run(keys(p.GROUP_ROUNDS))
    assert groups, "no group round was committed"
    for key in groups:
        data = asyncio.run(box.get(key))
        commit = p.decode_commit(key, data)
        assert commit.group == "x"
        assert [c.learner for c in commit.contributors] == ["exp-node-0"]


# -- gradientmail run's spec, the CRD, the operator's pods ---------------------------------


def test_the_flag_picks_moshpit_and_drops_the_local_diloco_defaults() -> None:
    loaded = load_spec(None, {"algorithm": "moshpit"}, default_mailbox="file:///tmp/box")
    assert loaded.spec.algorithm.name == "moshpit"
    assert loaded.spec.algorithm.fragments == 1  # the local default (2) is DiLoCo's
    written = loaded.resource["spec"]["algorithm"]
    assert written["name"] == "moshpit"
    assert {"groupSize", "gridDims"} <= set(written)
    assert not {"fragments", "outerLr", "outerMomentum", "quorum"} & set(written)
    diloco = load_spec(None, {}, default_mailbox="file:///tmp/box").resource["spec"]
    assert diloco["algorithm"]["fragments"] == 2
    assert not {"groupSize", "gridDims"} & set(diloco["algorithm"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"algorithm": "moshpit", "fragments": 2}, "--fragments: spec.algorithm.fragments: a "),
        ({"group_size": 8}, "--group-size: spec.algorithm.groupSize: a Moshpit setting"),
        ({"algorithm": "moshpit", "grid_dims": 9}, "--grid-dims: spec.algorithm.gridDims: "),
    ],
)
def test_a_flag_of_the_other_algorithm_is_named(flags: dict[str, object], message: str) -> None:
    with pytest.raises(CliError, match=message):
        load_spec(None, flags, default_mailbox="file:///tmp/box")


def test_a_spec_file_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("nodes: 4\nalgorithm:\n  name: moshpit\n  fragments: 4\n")
    with pytest.raises(CliError, match=r"run.yaml:4: spec.algorithm.fragments: a DiLoCo"):
        load_spec(path, {}, default_mailbox="file:///tmp/box")
    path.write_text("nodes: 4\nalgorithm: {name: moshpit}\n")
    assert load_spec(path, {}, default_mailbox="file:///tmp/box").spec.algorithm.grid_dims == 2


def test_the_crd_and_the_pods_carry_the_algorithm() -> None:
    assert CHART_CRD.read_text() == crd.render(), (
        "regenerate: python -m gradientmail_operator.crd > "
        "charts/gradientmail-operator/crds/gradientmailruns.yaml"
    )
    doc = yaml.safe_load(CHART_CRD.read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    algo = spec["properties"]["algorithm"]["properties"]
    assert algo["name"]["enum"] == ["diloco", "sparseloco", "moshpit"]
    assert algo["name"]["default"] == "diloco"
    assert (algo["groupSize"]["minimum"], algo["groupSize"]["maximum"]) == (2, 1000)
    assert (algo["gridDims"]["minimum"], algo["gridDims"]["maximum"]) == (1, 8)
    run = spec_of({"name": "moshpit", "groupSize": 2}, nodes=4)
    url = "s3://runs/gradientmail/ns/exp?endpoint=http%3A%2F%2Fminio%3A9000"
    pod = render.pod_manifest(run, namespace="ns", run="exp", uid="u", index=3, url=url)
    plain = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    assert plain["GRADIENTMAIL_ALGORITHM"] == "moshpit"
    assert NodeEnv.from_environ(plain).build_algorithm() == gm.Moshpit(
        sync_every=100, group_size=2, grid_dims=2
    )


# -- gradientmail run, end to end ------------------------------------------------------------


def test_gradientmail_run_with_moshpit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADIENTMAIL_TASK", "synthetic")  # seconds, not the LM's minute
    workdir = tmp_path / "run"
    done = cli(
        "run",
        *("--nodes", "4", "--algorithm", "moshpit", "--group-size", "2", "--grid-dims", "2"),
        *("--steps", "40", "--sync-every", "10", "--round-timeout", "3"),
        *("--workdir", workdir, "--no-live"),
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "syncEvery 10, Moshpit, groupSize 2, gridDims 2" in done.stdout
    for index in range(4):
        assert f"local-node-{index}: step 40 loss" in done.stdout
    resource = yaml.safe_load((workdir / "run.yaml").read_text())
    assert resource["spec"]["algorithm"]["name"] == "moshpit"
    box = open_mailbox((workdir / "mailbox").as_uri())

    async def read() -> tuple[list[str], list[p.Commit], p.Manifest]:
        rounds = list(await box.list(p.ROUNDS))
        keys = await box.list(p.GROUP_ROUNDS)
        commits = [p.decode_commit(k, await box.get(k)) for k in keys]
        manifest = p.decode_manifest(p.MANIFEST, await box.get(p.MANIFEST))
        return rounds, commits, manifest

    rounds, commits, manifest = asyncio.run(read())
    assert manifest.algorithm["name"] == "moshpit"
    assert (manifest.algorithm["group_size"], manifest.algorithm["grid_dims"]) == (2, 2)
    assert rounds == [p.round_key(0)]  # Moshpit's rounds are group rounds
    assert commits, "no group commit in the mailbox"
    learners = {f"local-node-{i}" for i in range(4)}
    for commit in commits:
        assert commit.group is not None
        assert commit.round >= 1
        assert {c.learner for c in commit.contributors} <= learners
    # The same mailbox again, with another grid: refused before any node starts.
    again = cli(
        "run",
        *("--nodes", "4", "--algorithm", "moshpit", "--group-size", "2", "--grid-dims", "3"),
        *("--sync-every", "10", "--mailbox", (workdir / "mailbox").as_uri(), "--no-live"),
        timeout=120,
    )
    assert again.returncode != 0
    assert "grid_dims: run has 2, these nodes have 3" in again.stderr
