"""Label and field selectors, parsed once and matched against JSON objects.

Label selectors follow the Kubernetes grammar: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``,
``a notin (x,y)``, ``a`` (exists), ``!a`` (does not exist), comma-separated (all must hold).

Field selectors are ``path=value``, ``path==value`` or ``path!=value``, comma-separated, where
``path`` is a dotted path into the object (``metadata.name``, ``status.phase``,
``involvedObject.uid``). The real API server accepts only a few fields per type; this one
accepts any path (documented in ``testbed/kube/__init__.py``). A missing field compares as "".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FieldSelector", "LabelSelector", "SelectorError"]


class SelectorError(ValueError):
    """A selector that does not parse (the API answers 400 BadRequest)."""


_KEY = r"[A-Za-z0-9./_-]+"
_VALUE = r"[A-Za-z0-9._-]*"
_SET_RE = re.compile(rf"^\s*(!?)\s*({_KEY})\s+(in|notin)\s*\(([^)]*)\)\s*$")
_EQ_RE = re.compile(rf"^\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*$")
_EXISTS_RE = re.compile(rf"^\s*(!?)\s*({_KEY})\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [part for part in parts if part.strip()]


Requirement = Callable[[Mapping[str, str]], bool]


@dataclass(frozen=True)
class LabelSelector:
    """A parsed label selector; the empty selector matches everything."""

    text: str
    requirements: tuple[Requirement, ...]

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        text = text or ""
        return cls(text, tuple(_label_requirement(part) for part in _split_top_level(text)))

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        labels = labels or {}
        return all(requirement(labels) for requirement in self.requirements)


def _label_requirement(part: str) -> Requirement:
    if match := _SET_RE.match(part):
        if match.group(1):
            raise SelectorError(f"invalid label selector term {part!r}")
        key, operator = match.group(2), match.group(3)
        values = frozenset(v.strip() for v in match.group(4).split(",") if v.strip())
        if operator == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQ_RE.match(part):
        key, operator, value = match.groups()
        if operator == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: key in labels and labels[key] == value
    if match := _EXISTS_RE.match(part):
        negated, key = match.groups()
        if negated:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise SelectorError(f"invalid label selector term {part!r}")


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The value at a dotted path as a string ("" when missing; booleans as true/false)."""
    node: Any = obj
    for segment in path.split("."):
        if not isinstance(node, Mapping) or segment not in node:
            return ""
        node = node[segment]
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    if isinstance(node, dict | list):
        return ""
    return str(node)


@dataclass(frozen=True)
class FieldSelector:
    """A parsed field selector: (path, operator, value) terms that must all hold."""

    text: str
    terms: tuple[tuple[str, str, str], ...]

    @classmethod
    def parse(cls, text: str | None) -> FieldSelector:
        text = text or ""
        terms = []
        for part in _split_top_level(text):
            match = re.match(r"^\s*([A-Za-z0-9._-]+)\s*(==|=|!=)\s*(.*?)\s*$", part)
            if match is None:
                raise SelectorError(f"invalid field selector term {part!r}")
            terms.append((match.group(1), match.group(2), match.group(3)))
        return cls(text, tuple(terms))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        for path, operator, value in self.terms:
            actual = field_value(obj, path)
            if (actual == value) != (operator != "!="):
                return False
        return True

    def exact_name(self) -> str | None:
        """The name when the selector pins ``metadata.name=X`` (kubectl's single-object watch)."""
        for path, operator, value in self.terms:
            if path == "metadata.name" and operator != "!=":
                return value
        return None
