"""The shapes of the registry (no torch): a :class:`Setting` (one field: kind, default,
bounds, one line of description), an :class:`AlgorithmInfo` and a :class:`CompressorInfo`
(a name and its settings), and the one check every consumer runs (:meth:`Setting.check`),
so a bad value reads the same from a dataclass, the node environment, a flag or a resource.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["AlgorithmInfo", "CompressorInfo", "Kind", "Setting", "camel"]

Kind = Literal["int", "float", "bool", "choice", "text"]
# How a round is exchanged: "rounds" (run-wide rounds, one closer combines every
# contribution) or "groups" (Moshpit: small groups on a grid, each closed by a member).
ExchangeKind = Literal["rounds", "groups"]


def camel(name: str) -> str:
    """``sync_every`` -> ``syncEvery``: a setting's name in a resource and in run.yaml."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _number(value: Any) -> str:
    return repr(value)


def _alternatives(choices: tuple[Any, ...]) -> str:
    shown = [repr(c) for c in choices]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


@dataclass(frozen=True)
class Setting:
    """One setting: its snake_case ``name``, what values it takes, its default."""

    name: str
    kind: Kind
    default: Any
    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    nullable: bool = False  # None is a value of its own (Session(mixing=None))

    @property
    def alias(self) -> str:
        return camel(self.name)

    @property
    def env_var(self) -> str:
        return "GRADIENTMAIL_" + self.name.upper()

    def rule(self) -> str:
        """What a valid value is, in words: ``an int >= 1``, ``a number in (0, 1]``."""
        if self.kind == "choice":
            text = _alternatives(self.choices)
        elif self.kind == "bool":
            text = "True or False"
        elif self.kind == "text":
            text = "a string"
        else:
            noun = "an int" if self.kind == "int" else "a number"
            low = self.ge if self.ge is not None else self.gt
            high = self.le if self.le is not None else self.lt
            if low is not None and high is not None:
                if self.kind == "int" and self.ge is not None and self.le is not None:
                    text = f"{noun} in {int(self.ge)}..{int(self.le)}"
                else:
                    left = "[" if self.ge is not None else "("
                    right = "]" if self.le is not None else ")"
                    text = f"{noun} in {left}{_number(low)}, {_number(high)}{right}"
            elif self.gt == 0 and self.kind == "float":
                text = "a positive number"
            elif low is not None:
                text = f"{noun} {'>=' if self.ge is not None else '>'} {_number(low)}"
            elif high is not None:
                text = f"{noun} {'<=' if self.le is not None else '<'} {_number(high)}"
            else:
                text = noun
        return f"None or {text}" if self.nullable else text

    def valid(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.kind == "choice":
            return any(type(value) is type(c) and value == c for c in self.choices)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "text":
            return isinstance(value, str)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.kind == "int" and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return not (
            (self.ge is not None and value < self.ge)
            or (self.gt is not None and value <= self.gt)
            or (self.le is not None and value > self.le)
            or (self.lt is not None and value >= self.lt)
        )

    def check(self, owner: str, value: Any) -> None:
        """``ValueError`` ``{owner}({name}={value!r}) must be {rule}``: the one error text a
        bad value gets, wherever it came from."""
        if not self.valid(value):
            raise ValueError(f"{owner}({self.name}={value!r}) must be {self.rule()}")

    def parse(self, text: str) -> Any:
        """The value ``text`` (an environment variable, a ``key=value`` item) stands for;
        ``ValueError`` naming the kind when it is not one."""
        if self.nullable and text.strip().lower() in ("none", "null"):
            return None
        kind = self.kind
        if kind == "choice":
            kind = "int" if isinstance(self.choices[0], int) else "text"
        try:
            if kind == "int":
                return int(text)
            if kind == "float":
                return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a {'int' if kind == 'int' else 'float'}") from None
        if kind == "bool":
            lowered = text.strip().lower()
            if lowered in ("true", "1", "yes"):
                return True
            if lowered in ("false", "0", "no"):
                return False
            raise ValueError(f"{text!r} is not true or false")
        return text


@dataclass(frozen=True)
class CompressorInfo:
    """A compressor of pseudo-gradients (``gm.TopK``, ``gm.Cast``, ``gm.Quantize``)."""

    name: str  # its settings' "name" (topk, cast, quantize)
    title: str  # its class (TopK)
    description: str
    fields: tuple[Setting, ...]

    def field(self, name: str) -> Setting:
        for setting in self.fields:
            if setting.name == name:
                return setting
        raise KeyError(name)


@dataclass(frozen=True)
class AlgorithmInfo:
    """An algorithm: its name (the manifest's ``algorithm.name``), class, exchange, the
    settings the manifest records (with this algorithm's defaults) and its capabilities."""

    name: str
    title: str
    description: str
    exchange: ExchangeKind
    fields: tuple[Setting, ...]
    compression: Literal["none", "optional", "required"] = "none"
    default_compression: dict[str, Any] | None = None
    # Fields the class carries at a fixed value (SparseLoCo: no outer momentum); a value
    # other than this one is refused.
    fixed: dict[str, Any] = field(default_factory=dict)

    def field(self, name: str) -> Setting:
        for setting in self.fields:
            if setting.name == name:
                return setting
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        """The settings this algorithm takes, ``compression`` included when it has one."""
        own = tuple(s.name for s in self.fields)
        return own + (("compression",) if self.compression != "none" else ())

    @property
    def dense_every(self) -> bool:
        """Capability: commits may leave their parameters unstored (``dense_every``)."""
        return any(s.name == "dense_every" for s in self.fields)

    def defaults(self) -> dict[str, Any]:
        return {s.name: s.default for s in self.fields}
