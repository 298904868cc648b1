"""Algorithms: what a contribution is and how a round combines contributions.

- ``base.py``: :class:`Algorithm`, the protocol the round engine calls (schedule, split,
  combine, the state kept with a commit), and the registry a manifest is read with.
- ``diloco.py``: :class:`DiLoCo`, local training with an outer Nesterov step over
  sample-weighted pseudo-gradients, streamed by fragments.
- ``sparseloco.py``: :class:`SparseLoCo`, DiLoCo with error feedback in place of outer
  momentum, over top-k compressed pseudo-gradients.
- ``moshpit.py``: :class:`Moshpit`, local training averaged in small groups that rotate
  over a virtual grid (Moshpit SGD), and the grid arithmetic (group keys, indices).
- ``compression.py``: the compressors (:class:`TopK`, :class:`Cast`, :class:`Quantize`):
  deterministic encode and decode of one tensor's pseudo-gradient.
- ``contribution.py``: a learner's compressed contribution with error feedback, and how a
  round sums such contributions.
"""

from gradientmail.algorithms.base import Algorithm, from_manifest
from gradientmail.algorithms.compression import Cast, Compression, Quantize, TopK
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.algorithms.moshpit import Moshpit
from gradientmail.algorithms.sparseloco import SparseLoCo

__all__ = [
    "Algorithm",
    "Cast",
    "Compression",
    "DiLoCo",
    "Moshpit",
    "Quantize",
    "SparseLoCo",
    "TopK",
    "from_manifest",
]
