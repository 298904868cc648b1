"""manifests/ (generated from the chart, examples, kind), the Dockerfiles, the Makefile and
the GitHub workflows: everything the kind + MinIO end-to-end workflow uses, checked here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gradientmail.launch.runspec import GradientMailRunSpec
from tests.charts import manifests, validate
from tests.charts.helm import CHART, NAMESPACE, ROOT, template

WORKFLOWS = ROOT / ".github" / "workflows"
IMAGES = ROOT / "images"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_rendered_manifests_match_the_chart() -> None:
    assert manifests.drifted() == [], (
        "manifests/ drifted from the chart: run `make manifests` (python -m tests.charts.manifests)"
    )


@pytest.mark.parametrize(
    "path",
    [
        "manifests/install.yaml",
        "manifests/kind/minio.yaml",
        "manifests/examples/s3-credentials.yaml",
    ],
)
def test_manifests_are_valid_kubernetes_documents(path: str) -> None:
    docs = _docs(ROOT / path)
    assert docs
    validate.validate_all(docs)


def test_install_yaml_is_the_namespace_and_the_default_chart() -> None:
    docs = _docs(manifests.MANIFESTS / "install.yaml")
    assert docs[0] == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "gradientmail"}},
    }
    assert docs[1:] == template(include_crds=True)


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((CHART / "crds" / "gradientmailruns.yaml").read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def test_the_moshpit_example_is_valid_and_fills_its_grid() -> None:
    run = yaml.safe_load(
        (manifests.MANIFESTS / "examples" / "gradientmailrun-moshpit.yaml").read_text()
    )
    jsonschema.Draft4Validator(_crd_schema()).validate(run)
    spec = GradientMailRunSpec.model_validate(run["spec"])
    algorithm = spec.algorithm
    assert algorithm.name == "moshpit"
    assert algorithm.group_size**algorithm.grid_dims == spec.nodes  # a full grid


def test_the_example_run_is_valid_for_the_crd_and_the_operator() -> None:
    run = yaml.safe_load((manifests.MANIFESTS / "examples" / "gradientmailrun.yaml").read_text())
    assert run["apiVersion"] == "gradientmail.dev/v1alpha1"
    assert run["kind"] == "GradientMailRun"
    jsonschema.Draft4Validator(_crd_schema()).validate(run)  # what the API server checks
    spec = GradientMailRunSpec.model_validate(run["spec"])  # what the operator checks
    assert spec.mailbox.credentials_secret is not None
    secret = yaml.safe_load((manifests.MANIFESTS / "examples" / "s3-credentials.yaml").read_text())
    assert spec.mailbox.credentials_secret.name == secret["metadata"]["name"]
    assert set(secret["stringData"]) == {
        spec.mailbox.credentials_secret.access_key_id_key,
        spec.mailbox.credentials_secret.secret_access_key_key,
    }
    # It points at the dev MinIO of manifests/kind/minio.yaml, and its bucket.
    minio = _docs(manifests.MANIFESTS / "kind" / "minio.yaml")
    service = next(d for d in minio if d["kind"] == "Service")
    assert spec.mailbox.endpoint == (
        f"http://{service['metadata']['name']}.{service['metadata']['namespace']}:9000"
    )
    job = next(d for d in minio if d["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][-1] == (
        f"local/{spec.mailbox.bucket}"
    )


def test_the_kind_config() -> None:
    config = yaml.safe_load((manifests.MANIFESTS / "kind" / "kind-config.yaml").read_text())
    assert config["kind"] == "Cluster"
    assert config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert [n["role"] for n in config["nodes"]] == ["control-plane"]
    assert re.fullmatch(r"kindest/node:v\d+\.\d+\.\d+", config["nodes"][0]["image"])


@pytest.mark.parametrize("image", ["operator", "node"])
def test_the_dockerfiles_are_small_non_root_and_pinned(image: str) -> None:
    text = (IMAGES / image / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert base is not None
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1))
    assert text.count("FROM ${PYTHON_IMAGE}") == 2, "a build stage and a runtime stage"
    user = re.findall(r"^USER (\d+):(\d+)$", text, re.M)
    assert user, "runs as a numeric user"
    assert all(int(uid) > 0 for uid, _ in user), "runs as a non-root user"
    assert "latest" not in text
    ignore = (IMAGES / image / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignore, "the build context is allow-listed"


def test_the_operator_image_matches_the_chart() -> None:
    from tests.charts.helm import one

    text = (IMAGES / "operator" / "Dockerfile").read_text()
    deployment = one(template(), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert f'ENTRYPOINT ["{container["command"][0]}", "{container["command"][1]}"]' in text
    uid = deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in text
    assert "pip install . ./operator" in text
    assert "torch==" not in text
    # The node image runs as the user the operator's node pods ask for.
    from gradientmail_operator.render import RESTRICTED_POD_SECURITY

    node = (IMAGES / "node" / "Dockerfile").read_text()
    node_uid = RESTRICTED_POD_SECURITY["runAsUser"]
    assert f"USER {node_uid}:{node_uid}" in node


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", text, re.M))


def test_make_knows_the_images_and_manifests_targets() -> None:
    targets = _make_targets()
    assert {"images", "manifests", "crd", "test", "kind-up", "kind-load"} <= targets
    dry = subprocess.run(
        ["make", "-n", "images", "TAG=t"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if dry.returncode == 127 or "No such file" in dry.stderr:
        pytest.skip("make is not installed")
    assert "images/operator/Dockerfile" in dry.stdout
    assert "images/node/Dockerfile" in dry.stdout


def _workflow(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((WORKFLOWS / name).read_text()))


def _steps(workflow: dict[str, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_ci_workflow_runs_ci_run() -> None:
    workflow = _workflow("ci.yml")
    runs = [s.get("run", "") for s in _steps(workflow)]
    assert ".ci/run" in runs
    assert (ROOT / ".ci" / "run").exists()
    assert workflow["permissions"] == {"contents": "read"}


def test_e2e_workflow_uses_what_exists_here() -> None:
    workflow = _workflow("e2e.yml")
    text = (WORKFLOWS / "e2e.yml").read_text()
    for path in sorted(
        set(re.findall(r"(?:manifests|charts)/[\w./-]+\.ya?ml|charts/[\w-]+", text))
    ):
        assert (ROOT / path).exists(), f"e2e.yml names {path}, which does not exist"
    for target in re.findall(r"\bmake (\w[\w-]*)", text):
        assert target in _make_targets(), f"e2e.yml runs `make {target}`"
    steps = _steps(workflow)
    uses = [s.get("uses", "") for s in steps]
    assert any(u.startswith("helm/kind-action@") for u in uses)
    run = "\n".join(s.get("run", "") for s in steps)
    assert "kind load docker-image" in run
    assert "helm install" in run
    assert "Succeeded" in run
    dump = [s for s in steps if s.get("if") == "failure()"]
    assert dump
    assert "kubectl logs" in dump[0]["run"]
    assert "get gmr -A -o yaml" in dump[0]["run"]
    # The run it waits for is the example's.
    example = yaml.safe_load(
        (manifests.MANIFESTS / "examples" / "gradientmailrun.yaml").read_text()
    )
    assert f"get gmr {example['metadata']['name']}" in run


# -- make images: docker or podman ---------------------------------------------------------------


def _make_images(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``make images`` with only ``path`` on PATH (plus make itself, by its full path)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    return subprocess.run(
        [make, "--no-print-directory", "images", "TAG=t", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": str(path), "HOME": str(path)},
        timeout=60,
        check=False,
    )


def _fake_engine(directory: Path, name: str) -> None:
    """A ``name`` that prints its arguments, as an installed container engine."""
    script = directory / name
    script.write_text(f'#!/bin/sh\necho "{name} $*"\n')
    script.chmod(0o755)


def test_make_images_says_so_when_no_container_engine_is_installed(tmp_path: Path) -> None:
    result = _make_images(tmp_path)
    assert result.returncode != 0
    assert "no container engine: install docker or podman" in result.stderr
    assert "build" not in result.stdout


@pytest.mark.parametrize(
    ("installed", "used"), [(["podman"], "podman"), (["docker", "podman"], "docker")]
)
def test_make_images_uses_docker_or_podman(tmp_path: Path, installed: list[str], used: str) -> None:
    for name in installed:
        _fake_engine(tmp_path, name)
    result = _make_images(tmp_path)
    assert result.returncode == 0, result.stderr
    builds = [line for line in result.stdout.splitlines() if line.startswith(f"{used} build")]
    assert builds == [
        f"{used} build -f images/operator/Dockerfile -t ghcr.io/gradientmail/operator:t .",
        f"{used} build -f images/node/Dockerfile -t ghcr.io/gradientmail/node:t .",
    ]


# -- the release workflow ------------------------------------------------------------------------


def _release() -> dict[str, Any]:
    return _workflow("release.yml")


def _version_step() -> dict[str, Any]:
    steps = _release()["jobs"]["version"]["steps"]
    return next(s for s in steps if s.get("id") == "version")


def test_the_release_workflow_pushes_both_images_multi_arch_on_a_tag() -> None:
    workflow = _release()
    on = workflow.get("on", workflow.get(True))  # PyYAML reads the key `on` as True
    assert on == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"] == {"contents": "read"}
    # The registry the README and the chart name.
    registry = workflow["env"]["REGISTRY"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == f"{registry}/operator"
    assert values["nodePods"]["image"]["repository"] == f"{registry}/node"
    assert f"`{registry}/operator`" in (ROOT / "README.md").read_text()
    job = workflow["jobs"]["images"]
    assert job["needs"] == "version"
    assert job["permissions"] == {"contents": "read", "packages": "write"}
    images = job["strategy"]["matrix"]["image"]
    assert sorted(images) == ["node", "operator"]
    steps = job["steps"]
    build = next(s for s in steps if str(s.get("uses", "")).startswith("docker/build-push"))
    options = build["with"]
    for image in images:
        file = options["file"].replace("${{ matrix.image }}", image)
        assert (ROOT / file).exists(), file
    assert options["context"] == "."
    assert set(options["platforms"].split(",")) == {"linux/amd64", "linux/arm64"}
    assert options["push"] is True
    uses = [str(s.get("uses", "")) for s in steps]
    assert any(u.startswith("docker/setup-buildx-action@") for u in uses)
    assert any(u.startswith("docker/setup-qemu-action@") for u in uses)
    assert any(u.startswith("docker/login-action@") for u in uses)
    tags = next(s for s in steps if s.get("id") == "tags")
    assert "$IMAGE:$VERSION" in tags["run"]
    assert "$IMAGE:latest" in tags["run"]
    assert options["tags"] == "${{ steps.tags.outputs.tags }}"


def _run_version_check(tag: str, tmp_path: Path) -> tuple[int, str, dict[str, str]]:
    output = tmp_path / "github-output"
    output.write_text("")
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _version_step()["run"]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "GITHUB_REF_NAME": tag,
            "GITHUB_OUTPUT": str(output),
            "CHART": _release()["env"]["CHART"],
        },
        timeout=30,
        check=False,
    )
    pairs = dict(line.split("=", 1) for line in output.read_text().splitlines() if "=" in line)
    return result.returncode, result.stdout + result.stderr, pairs


def test_the_release_tag_must_be_the_charts_app_version(tmp_path: Path) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    rc, out, outputs = _run_version_check(f"v{app_version}", tmp_path)
    assert rc == 0, out
    assert outputs == {"version": app_version, "latest": "true"}
    for wrong in ("v9.9.9", app_version, f"v{app_version}.1", f"v{app_version}-rc.1"):
        rc, out, outputs = _run_version_check(wrong, tmp_path)
        assert rc != 0, wrong
        assert f"does not match {_release()['env']['CHART']} appVersion {app_version}" in out
        assert outputs == {}
