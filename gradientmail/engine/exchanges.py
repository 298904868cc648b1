"""The registry of exchanges: how a round of each kind (``settings.exchange_kind``) is
exchanged. A new way to exchange a round is one class implementing
:class:`~gradientmail.engine.exchange.Exchange` and one line here."""

from __future__ import annotations

from collections.abc import Callable

from gradientmail.engine.exchange import Exchange, ExchangeContext
from gradientmail.engine.exchange_groups import GroupsExchange
from gradientmail.engine.exchange_rounds import RoundsExchange
from gradientmail.settings import ExchangeKind, exchange_kind

__all__ = ["EXCHANGES", "exchange_for"]

EXCHANGES: dict[ExchangeKind, Callable[[ExchangeContext], Exchange]] = {
    "rounds": RoundsExchange,
    "groups": GroupsExchange,
}


def exchange_for(context: ExchangeContext) -> Exchange:
    """The exchange ``context.algorithm``'s rounds go through, for the learner it serves.
    An algorithm the settings do not describe (a user's own, registered with
    ``algorithms.base.register``) keeps the protocol's arithmetic only: run-wide rounds."""
    return EXCHANGES[exchange_kind(context.algorithm.name)](context)
