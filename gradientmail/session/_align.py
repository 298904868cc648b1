"""``align`` moved to :mod:`gradientmail.engine.align` (one read of a run's aligned model,
shared with ``gradientmail align``); re-exported here until ``session/__init__.py`` imports
it from there."""

from __future__ import annotations

from gradientmail.engine.align import align

__all__ = ["align"]
