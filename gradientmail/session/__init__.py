"""The learner: :class:`Session` (joins a run and trains in it) and :func:`align`.

- ``session.py``: :class:`Session`: its settings, joining, and its public surface
  (``step``, ``sync``, ``close``, counters);
- ``_training.py``: the training-thread side, mixed into the Session (sync points, bounded
  waits, contributions at close/sync, applying staged commits);
- ``_background.py``: the communication thread (publish, lease, close) and the syncer
  (poll, download, stage), mixed into the Session;
- ``_state.py``: the records handed between threads and the small pure rules of the loops;
- ``_resume.py``: resume saves (``optimizer=``), mixed into the Session: the optimizer's
  state and the counters stored every few sync points and loaded when the learner restarts;
  ``_optstate.py``: an optimizer's ``state_dict()`` as tagged JSON and tensors (no pickle);
- ``_align.py``: :func:`align`, the newest commits into a model without joining.
"""

from gradientmail.session._align import align
from gradientmail.session.session import Session

__all__ = ["Session", "align"]
