"""Algorithms: what a contribution is and how a round combines contributions.

- ``diloco.py``: :class:`DiLoCo`, local training with an outer Nesterov step over
  sample-weighted pseudo-gradients, streamed by fragments.
"""

from gradientmail.algorithms.diloco import DiLoCo

__all__ = ["DiLoCo"]
