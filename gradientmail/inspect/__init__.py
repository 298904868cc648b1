"""A read-only view of a run, built from its mailbox alone (``gradientmail status``, the
operator's status, the live table of ``gradientmail run``). torch-free; it only reads.

- ``_view.py``: :class:`RunWatcher` (a cursor over ``rounds/`` and a beat cache) and the
  :class:`RunView` it returns, with a :class:`LearnerView` per learner;
- ``_groups.py``: a Moshpit run's group rounds (:class:`GroupsView`), and whether a run
  has them (:func:`is_moshpit`, from the settings registry);
- ``_traffic.py``: the bytes the learners moved, against what dense float32 rounds would.
"""

from gradientmail.inspect._groups import GROUP_WINDOW, GroupRoundView, GroupsView, is_moshpit
from gradientmail.inspect._traffic import Traffic, describe_compression
from gradientmail.inspect._view import (
    STALLING_FRACTION,
    LearnerView,
    RunView,
    RunWatcher,
    SyncTotals,
    inspect_run,
)

__all__ = [
    "GROUP_WINDOW",
    "STALLING_FRACTION",
    "GroupRoundView",
    "GroupsView",
    "LearnerView",
    "RunView",
    "RunWatcher",
    "SyncTotals",
    "Traffic",
    "describe_compression",
    "inspect_run",
    "is_moshpit",
]
