"""``gradientmail run``'s spec: a GradientMailRun file (or flags), validated by the operator's
own models, with every error naming the field (and its line in the file).

The file is what ``kubectl apply`` takes (``apiVersion``/``kind``/``metadata``/``spec``) or
just its ``spec``. ``spec.mailbox`` may be left out: locally the run gets its own mailbox.
Flags override the file field by field; an error in a value that came from a flag names
the flag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gradientmail import settings
from gradientmail.cli._common import USAGE, CliError
from gradientmail.launch.runspec import (
    GROUP,
    KIND,
    SETTING_FIELDS,
    VERSION,
    AlgorithmSpec,
    GradientMailRunSpec,
)
from gradientmail.settings import camel, compression_from_text

__all__ = ["FLAG_FIELDS", "LOCAL_DEFAULTS", "LoadedSpec", "load_spec"]

# Without a file: a short run that shows rounds and a falling loss in seconds.
LOCAL_DEFAULTS: dict[str, Any] = {
    "nodes": 3,
    "algorithm": {"syncEvery": 25, "fragments": 2, "steps": 800, "roundTimeout": 5.0},
}

# argparse dest -> the spec field it sets (camelCase path, as in the file): every setting
# of the algorithm section (the registry's), the algorithm and compressor, the run's own.
FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "nodes": ("nodes",),
    "algorithm": ("algorithm", "name"),
    **{field: ("algorithm", camel(field)) for field in (*SETTING_FIELDS, "compression", "lm")},
    "max_restarts": ("maxRestarts",),
    **{field: (camel(field),) for field in settings.LAUNCH},  # procs_per_node
}


@dataclass(frozen=True)
class LoadedSpec:
    name: str  # metadata.name, or the default
    spec: GradientMailRunSpec
    has_mailbox: bool  # the file named a mailbox (else the local default was filled in)
    resource: dict[str, Any]  # the effective resource, for the run folder's run.yaml


def _path_text(loc: Sequence[str | int]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _line_of(node: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """The 1-based line of the deepest YAML node along ``loc`` (None without a file)."""
    line = None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        found: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                    found, line = value, key.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(part, int)
            and 0 <= part < len(node.value)
        ):
            found = node.value[part]
            line = found.start_mark.line + 1
        node = found
    return line


def _message(error: Mapping[str, Any]) -> str:
    kind, msg = error.get("type", ""), str(error.get("msg", ""))
    if kind == "extra_forbidden":
        return "unknown field (not part of a GradientMailRun spec)"
    if kind == "missing":
        return "required field is missing"
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    value = error.get("input")
    if kind not in ("model_type", "dict_type") and isinstance(value, str | int | float | bool):
        shown = repr(value)
        if len(shown) <= 60:
            msg += f" (got {shown})"
    return msg


def _yaml_error(where: str, exc: yaml.YAMLError) -> CliError:
    mark = getattr(exc, "problem_mark", None)
    line = f":{mark.line + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    return CliError(f"{where}{line}: not valid YAML: {problem}", USAGE)


def _read(path: Path) -> tuple[dict[str, Any], yaml.Node | None, bool]:
    """The file's GradientMailRun document, its YAML node tree, and whether it is a whole
    resource (apiVersion/kind/metadata/spec) rather than just a spec."""
    where = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise CliError(
            f"{where}: cannot read the spec file: {exc.strerror or exc}", USAGE
        ) from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
        nodes = [n for n in yaml.compose_all(text) if n is not None]
    except yaml.YAMLError as exc:
        raise _yaml_error(where, exc) from None
    if not documents:
        raise CliError(f"{where}: the file is empty; it should hold a GradientMailRun", USAGE)
    if len(documents) > 1:
        runs = [i for i, d in enumerate(documents) if isinstance(d, dict) and d.get("kind") == KIND]
        if len(runs) != 1:
            raise CliError(
                f"{where}: {len(documents)} YAML documents and {len(runs)} of them are a "
                f"{KIND}; give a file with exactly one",
                USAGE,
            )
        documents, nodes = [documents[runs[0]]], [nodes[runs[0]]]
    document, node = documents[0], nodes[0]
    if not isinstance(document, dict):
        raise CliError(
            f"{where}:{node.start_mark.line + 1}: expected a mapping (a {KIND} or its spec), "
            f"got {type(document).__name__}",
            USAGE,
        )
    is_resource = any(key in document for key in ("apiVersion", "kind", "spec", "metadata"))
    return document, node, is_resource


def _set(target: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for part in path[:-1]:
        child = target.get(part)
        if not isinstance(child, dict):
            child = target[part] = {}
        target = child
    target[path[-1]] = value


def load_spec(
    path: Path | None,
    overrides: Mapping[str, Any],
    *,
    default_mailbox: str,
    default_name: str = "local",
) -> LoadedSpec:
    """Validate the run ``path`` describes (or the local defaults) with ``overrides``
    (``FLAG_FIELDS`` dests; None means not given); raise :class:`CliError` naming the field."""
    where = "flags" if path is None else str(path)
    node: yaml.Node | None = None
    prefix: tuple[str, ...] = ()
    name = default_name
    if path is None:
        raw: dict[str, Any] = {
            k: dict(v) if isinstance(v, dict) else v for k, v in LOCAL_DEFAULTS.items()
        }
    else:
        document, node, is_resource = _read(path)
        if is_resource:
            prefix = ("spec",)
            checks = (("kind", KIND), ("apiVersion", f"{GROUP}/{VERSION}"))
            for field, wanted in checks:
                if document.get(field) != wanted:
                    line = _line_of(node, [field]) or 1
                    raise CliError(
                        f"{where}:{line}: {field}: expected {wanted!r}, got "
                        f"{document.get(field)!r}",
                        USAGE,
                    )
            metadata = document.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise CliError(
                    f"{where}:{_line_of(node, ['metadata'])}: metadata: not a mapping", USAGE
                )
            name = str(metadata.get("name") or default_name)
            raw_spec = document.get("spec")
            if not isinstance(raw_spec, dict):
                line = _line_of(node, ["spec"]) or 1
                raise CliError(
                    f"{where}:{line}: spec: expected a mapping with the run's spec", USAGE
                )
            raw = dict(raw_spec)
        else:
            raw = dict(document)
    has_mailbox = "mailbox" in raw
    if not has_mailbox:
        raw["mailbox"] = {"url": default_mailbox}
    flags: dict[tuple[str, ...], str] = {}
    for dest, value in overrides.items():
        if value is not None and dest in FLAG_FIELDS:
            option = "--" + dest.replace("_", "-")
            if dest == "compression":
                try:
                    value = compression_from_text(value)
                except ValueError as exc:
                    raise CliError(f"{option}: {exc}", USAGE) from None
            if isinstance(raw.get("algorithm"), dict):
                raw["algorithm"] = dict(raw["algorithm"])
            _set(raw, FLAG_FIELDS[dest], value)
            flags[FLAG_FIELDS[dest]] = option
    algorithm = raw.get("algorithm")
    if path is None and isinstance(algorithm, dict):
        # The local defaults that the chosen algorithm does not have (fragments under
        # Moshpit) are left out: `--algorithm moshpit` is Moshpit with the others.
        chosen = str(algorithm.get("name", "diloco"))
        for key in [k for k in LOCAL_DEFAULTS["algorithm"] if ("algorithm", k) not in flags]:
            setting = next((f for f in SETTING_FIELDS if camel(f) == key), None)
            if setting is not None and not settings.applies(setting, chosen):
                algorithm.pop(key, None)
    try:
        spec = GradientMailRunSpec.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            loc = tuple(error["loc"])
            flag = flags.get(tuple(str(x) for x in loc))
            # A check across fields (fragments <= syncEvery) names the flags that set them.
            related = [f for field, f in flags.items() if field[: len(loc)] == loc]
            at = None if flag is not None else _line_of(node, prefix + loc)
            place = flag or (where if path is not None or not related else ", ".join(related))
            if at is not None:
                place += f":{at}"
                if related:
                    place += f" (with {', '.join(related)})"
            lines.append(f"{place}: {_path_text(('spec', *loc))}: {_message(error)}")
        raise CliError("invalid run spec:\n  " + "\n  ".join(lines), USAGE) from None
    dumped = spec.model_dump(by_alias=True, exclude_none=True, mode="json")
    # The settings the algorithm does not have (at their defaults: anything else was
    # refused) would only be noise in run.yaml.
    for setting in (*SETTING_FIELDS, "compression", "lm"):
        if not settings.applies(setting, spec.algorithm.name):
            dumped["algorithm"].pop(AlgorithmSpec.model_fields[setting].alias or setting, None)
    resource = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name},
        "spec": dumped,
    }
    return LoadedSpec(name, spec, has_mailbox, resource)
