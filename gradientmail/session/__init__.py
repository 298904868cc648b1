"""The learner: :class:`Session` (joins a run and trains in it) and :func:`align`.

- ``session.py``: :class:`Session`, its public surface and the training-thread side
  (sync points, bounded waits, applying staged commits);
- ``_background.py``: the communication thread (publish, lease, close) and the syncer
  (poll, download, stage), mixed into the Session;
- ``_state.py``: the records handed between threads and the small pure rules of the loops;
- ``_align.py``: :func:`align`, the newest commits into a model without joining.
"""

from gradientmail.session._align import align
from gradientmail.session.session import Session

__all__ = ["Session", "align"]
