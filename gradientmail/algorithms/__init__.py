"""Algorithms: what a contribution is and how a round combines contributions.

- ``base.py``: :class:`Algorithm`, the protocol the round engine calls (schedule, split,
  combine, the state kept with a commit), and the registry a manifest is read with.
- ``diloco.py``: :class:`DiLoCo`, local training with an outer Nesterov step over
  sample-weighted pseudo-gradients, streamed by fragments.
"""

from gradientmail.algorithms.base import Algorithm, from_manifest
from gradientmail.algorithms.diloco import DiLoCo

__all__ = ["Algorithm", "DiLoCo", "from_manifest"]
