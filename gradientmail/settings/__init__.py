"""One home for every setting (torch-free): what each algorithm and compressor is called,
its fields, defaults, bounds and capabilities. The algorithm classes validate with it;
``launch/runspec.py`` (the GradientMailRun spec and so the CRD and the operator's
validation), ``launch/env.py`` (the node environment), the CLI flags of ``gradientmail
run`` and ``inspect`` derive from it.

- ``_model.py``: :class:`Setting` (kind, default, bounds, the one error text),
  :class:`AlgorithmInfo`, :class:`CompressorInfo`.
- ``_catalog.py``: the entries: ``ALGORITHMS`` (diloco, sparseloco, moshpit),
  ``COMPRESSORS`` (topk, cast, quantize), ``SESSION`` (quorum, round_timeout, overlap,
  mixing, keep_rounds, with the exchanges they apply to), ``NODE`` (the built-in node's
  steps and task), ``LM_SIZES`` (its language model's sizes) and ``LAUNCH`` (how each
  node is launched: procs_per_node, the run's ``spec.procsPerNode``).
- ``_text.py``: a compressor's settings as one line (``topk:density=0.05,bits=4``), as the
  node environment carries them.

Callers use :func:`exchange_of` and :func:`dense_every` instead of comparing algorithm
names or classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradientmail.settings._catalog import (
    ALGORITHMS,
    COMPRESSORS,
    LAUNCH,
    LM_SIZES,
    MAX_GRID_DIMS,
    MAX_GROUP_SIZE,
    NODE,
    SESSION,
    TOPK_MAX_CHUNK,
)
from gradientmail.settings._model import (
    AlgorithmInfo,
    CompressorInfo,
    ExchangeKind,
    Setting,
    camel,
)
from gradientmail.settings._text import compression_from_text, compression_to_text

__all__ = [
    "ALGORITHMS",
    "COMPRESSORS",
    "LAUNCH",
    "LM_SIZES",
    "MAX_GRID_DIMS",
    "MAX_GROUP_SIZE",
    "NODE",
    "SESSION",
    "TOPK_MAX_CHUNK",
    "AlgorithmInfo",
    "CompressorInfo",
    "ExchangeKind",
    "Setting",
    "algorithm_info",
    "applies",
    "camel",
    "check",
    "compression_from_text",
    "compression_to_text",
    "compressor_info",
    "dense_every",
    "exchange_kind",
    "exchange_of",
    "owners",
]


def _unknown(what: str, name: object, known: Mapping[str, Any]) -> ValueError:
    return ValueError(f"unknown {what} {name!r} (known: {', '.join(sorted(known))})")


def algorithm_info(name: str) -> AlgorithmInfo:
    """The entry of the algorithm called ``name``; ``ValueError`` naming the known ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise _unknown("algorithm", name, ALGORITHMS) from None


def compressor_info(name: str) -> CompressorInfo:
    """The entry of the compressor called ``name``; ``ValueError`` naming the known ones."""
    try:
        return COMPRESSORS[name]
    except KeyError:
        raise _unknown("compression", name, COMPRESSORS) from None


def check(owner: str, fields: tuple[Setting, ...], obj: object) -> None:
    """Every one of ``fields`` of ``obj`` (a dataclass carrying them) checked, the first
    bad one raising ``{owner}({name}={value!r}) must be {rule}``."""
    for setting in fields:
        setting.check(owner, getattr(obj, setting.name))


def exchange_of(name: str) -> ExchangeKind:
    """How rounds of the algorithm called ``name`` (a manifest's ``algorithm.name``) are
    exchanged. Raises ``ValueError`` naming an unknown algorithm."""
    return algorithm_info(name).exchange


def exchange_kind(name: object) -> ExchangeKind:
    """:func:`exchange_of`, for readers of a run and for the Session: an algorithm the
    registry does not describe (a user's own, registered with
    ``algorithms.base.register``; a manifest of a newer release; none yet) exchanges
    run-wide rounds, the round engine's own seam for an algorithm's arithmetic."""
    info = ALGORITHMS.get(name) if isinstance(name, str) else None
    return "rounds" if info is None else info.exchange


def dense_every(settings: Mapping[str, Any]) -> int:
    """Every how many rounds of a fragment a commit stores its parameters, from an
    algorithm's settings (a manifest's ``algorithm``): its ``dense_every`` where the
    algorithm declares that capability, else 1 (every round)."""
    info = ALGORITHMS.get(str(settings.get("name", "diloco")))
    if info is None or not info.dense_every:
        return 1
    every = settings.get("dense_every", 1)
    return every if isinstance(every, int) and not isinstance(every, bool) and every >= 1 else 1


def owners(setting: str) -> tuple[str, ...]:
    """The algorithms a run-level setting applies to (an algorithm field, ``compression``,
    or a Session setting by the exchanges it serves), in registry order; every algorithm
    for the built-in node's settings and the launch's."""
    if setting in SESSION:
        exchanges = SESSION[setting][1]
        return tuple(n for n, info in ALGORITHMS.items() if info.exchange in exchanges)
    if setting in NODE or setting in LAUNCH or setting == "lm":
        return tuple(ALGORITHMS)
    return tuple(n for n, info in ALGORITHMS.items() if setting in info.names)


def applies(setting: str, algorithm: str) -> bool:
    """Whether ``setting`` means anything to a run of ``algorithm``."""
    return algorithm in owners(setting)
