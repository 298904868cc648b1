"""The chart README's values table, generated from ``values.yaml`` (helm-docs style).

A ``# -- text`` comment (continued by further ``# …`` lines) documents the key right below
it; the table lists each documented key with its type and default. ``python -m
tests.charts.docs`` rewrites the table between the README's markers; ``--check`` exits 1
when it drifted. helm-docs itself is a Go binary this machine cannot fetch; its comment
format is kept, so it can take over.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from tests.charts.helm import CHART

VALUES = CHART / "values.yaml"
README = CHART / "README.md"
START, END = "<!-- values:start -->", "<!-- values:end -->"

_KEY = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(\s|$)")
_DOC = re.compile(r"^(\s*)# -- ?(.*)$")
_MORE = re.compile(r"^\s*# ?(.*)$")


@dataclass(frozen=True)
class Documented:
    path: tuple[str, ...]
    description: str

    @property
    def key(self) -> str:
        return ".".join(self.path)


def documented(text: str) -> list[Documented]:
    """The documented keys of a values file, in file order."""
    out: list[Documented] = []
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    for line in text.splitlines():
        doc = _DOC.match(line)
        if doc:
            pending = [doc.group(2).strip()]
            continue
        if pending is not None and line.strip().startswith("#"):
            more = _MORE.match(line)
            pending.append(more.group(1).strip() if more else "")
            continue
        key = _KEY.match(line)
        if not key:
            if not line.strip():
                pending = None
            continue
        indent = len(key.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key.group(2)))
        if pending is not None:
            path = tuple(name for _, name in stack)
            out.append(Documented(path, " ".join(p for p in pending if p)))
            pending = None
    return out


def lookup(values: dict[str, Any], path: Sequence[str]) -> Any:
    node: Any = values
    for part in path:
        node = node[part]
    return node


def leaves(values: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path whose value is not a non-empty mapping."""
    if isinstance(values, dict) and values:
        for key, value in values.items():
            yield from leaves(value, (*path, key))
    else:
        yield path


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return "object"


def table(text: str | None = None) -> str:
    text = VALUES.read_text() if text is None else text
    values = yaml.safe_load(text)
    rows = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for item in documented(text):
        value = lookup(values, item.path)
        default = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        description = item.description.replace("|", "\\|")
        rows.append(f"| {item.key} | {type_name(value)} | `{default}` | {description} |")
    return "\n".join(rows)


def readme(current: str | None = None) -> str:
    current = README.read_text() if current is None else current
    head, start, rest = current.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"{README} lacks the {START} … {END} markers")
    return f"{head}{START}\n{table()}\n{END}{tail}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report drift (exit 1)")
    args = parser.parse_args(argv)
    wanted = readme()
    if args.check:
        if README.read_text() != wanted:
            print(f"{README}: the values table drifted from values.yaml")
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
