"""One home for every setting (torch-free): what each algorithm and compressor is called,
its fields, defaults, bounds and capabilities. The algorithm classes, ``launch/runspec.py``,
the node environment, ``inspect``, the CLI flags, the CRD schema and the operator's
validation derive from it.

SKELETON (house issue, in progress): only :func:`exchange_of` exists yet; the rest of the
registry is being written. Callers use :func:`exchange_of` instead of comparing algorithm
names or classes.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["ExchangeKind", "exchange_of"]

# How a round is exchanged: "rounds" (run-wide rounds, one closer combines every
# contribution) or "groups" (Moshpit: small groups on a grid, each closed by a member).
ExchangeKind = Literal["rounds", "groups"]

_EXCHANGES: dict[str, ExchangeKind] = {
    "diloco": "rounds",
    "sparseloco": "rounds",
    "moshpit": "groups",
}


def exchange_of(name: str) -> ExchangeKind:
    """How rounds of the algorithm called ``name`` (a manifest's ``algorithm.name``) are
    exchanged. Raises ``ValueError`` naming an unknown algorithm."""
    try:
        return _EXCHANGES[name]
    except KeyError:
        known = ", ".join(sorted(_EXCHANGES))
        raise ValueError(f"unknown algorithm {name!r} (known: {known})") from None
