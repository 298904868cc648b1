"""The chart, and the real helm binary that lints and renders it."""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from testbed.kube.binaries import helm_path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "gradientmail-operator"
CI_VALUES = CHART / "ci"
RELEASE = "gradientmail-operator"
NAMESPACE = "gradientmail"
HELM_TIMEOUT_S = 60.0

Values = dict[str, Any]


def helm_env(base: Mapping[str, str] | None = None, home: Path | None = None) -> dict[str, str]:
    """The environment, with helm's cache, config and data under ``home`` (a temp dir)."""
    env = dict(os.environ if base is None else base)
    home = home or Path(tempfile.gettempdir()) / "gradientmail-helm-home"
    for name in ("CACHE", "CONFIG", "DATA"):
        env[f"HELM_{name}_HOME"] = str(home / name.lower())
    return env


def helm(
    *args: str, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run helm to completion; with ``check``, a non-zero exit fails with its output."""
    result = subprocess.run(
        [str(helm_path()), *args],
        capture_output=True,
        text=True,
        env=helm_env(env),
        timeout=HELM_TIMEOUT_S,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"helm {' '.join(args)} exited {result.returncode}\n"
            f"stdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result


def values_args(values: Values | None, files: Sequence[Path] = ()) -> tuple[list[str], Path | None]:
    """``-f`` arguments for value files and a dict (written to a temp file: the caller
    deletes the returned path)."""
    args = [arg for f in files for arg in ("-f", str(f))]
    if not values:
        return args, None
    with tempfile.NamedTemporaryFile(
        "w", suffix=".yaml", prefix="gm-values-", delete=False, encoding="utf-8"
    ) as handle:
        yaml.safe_dump(values, handle)
    return [*args, "-f", handle.name], Path(handle.name)


def template_text(
    values: Values | None = None,
    *,
    files: Sequence[Path] = (),
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    include_crds: bool = False,
    show_only: Sequence[str] = (),
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    args, temp = values_args(values, files)
    try:
        extra = ["--include-crds"] if include_crds else []
        for template in show_only:
            extra += ["--show-only", template]
        return helm(
            "template", release, str(CHART), "--namespace", namespace, *extra, *args, check=check
        )
    finally:
        if temp is not None:
            temp.unlink()


def template(values: Values | None = None, **options: Any) -> list[dict[str, Any]]:
    """``helm template``'s documents, parsed."""
    text = template_text(values, **options).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def lint(values: Values | None = None, files: Sequence[Path] = ()) -> str:
    args, temp = values_args(values, files)
    try:
        return helm("lint", "--strict", str(CHART), *args).stdout
    finally:
        if temp is not None:
            temp.unlink()


def find(
    docs: Sequence[dict[str, Any]], kind: str, name: str | None = None
) -> list[dict[str, Any]]:
    return [
        d for d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: Sequence[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = find(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# -- the value combinations ------------------------------------------------------------------

SWITCHES: dict[str, list[Any]] = {
    # The values that change which objects exist or how they are bound: every combination.
    "watchNamespaces": [[], ["team-a"], ["team-a", "team-b", "team-a"]],
    "minio.enabled": [False, True],
    "rbac.create": [True, False],
    "serviceAccount.create": [True, False],
}
CHOICES: dict[str, list[Any]] = {
    # Enumerations: each value once, on top of the defaults.
    "operator.logLevel": ["info", "debug", "warning"],
    "operator.logFormat": ["full", "plain", "json"],
    "image.pullPolicy": ["Always", "IfNotPresent", "Never"],
    "nodePods.image.pullPolicy": ["", "Always", "IfNotPresent", "Never"],
    "metrics.enabled": [True, False],
    "metrics.serviceMonitor.enabled": [True, False],
    "metrics.dashboard.enabled": [True, False],
}


def nested(flat: Mapping[str, Any]) -> Values:
    """``{"a.b": 1}`` → ``{"a": {"b": 1}}``."""
    out: Values = {}
    for dotted, value in flat.items():
        *parents, last = dotted.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def combinations() -> Iterator[tuple[str, Values]]:
    """(id, values): the defaults, every ``ci/*-values.yaml`` file (the documented
    examples, as chart-testing runs them), every combination of :data:`SWITCHES` and each
    value of :data:`CHOICES`."""
    yield "defaults", {}
    for path in sorted(CI_VALUES.glob("*-values.yaml")):
        yield f"ci/{path.name}", yaml.safe_load(path.read_text()) or {}
    keys = list(SWITCHES)
    for picked in itertools.product(*(SWITCHES[k] for k in keys)):
        flat = dict(zip(keys, picked, strict=True))
        if not flat["serviceAccount.create"]:
            flat["serviceAccount.name"] = "existing-operator-account"
        label = ",".join(f"{k}={v}" for k, v in flat.items() if k != "serviceAccount.name")
        yield label.replace(" ", ""), nested(flat)
    for key, options in CHOICES.items():
        for option in options:
            yield f"{key}={option}", nested({key: option})
