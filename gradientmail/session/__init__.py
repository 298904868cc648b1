"""The learner: :class:`Session` (joins a run and trains in it).

- ``session.py``: :class:`Session`: its settings, joining, and its public surface
  (``step``, ``sync``, ``close``, counters); it composes the pieces below and ONE exchange
  (``engine/exchange.py``), chosen once from the algorithm (``engine/exchanges.py``);
- ``_state.py``: :class:`Shared`, the state the threads share (the hand-off, the one
  staging path, counters, events, wakes), and the small pure rules of the loops;
- ``_training.py``: :class:`TrainingLoop`, the training-thread side (step count and sync
  schedule, sync points, bounded waits, contributions at close/sync, applying staged
  commits);
- ``_comm.py``: :class:`Communication`, the background threads: the communication loop
  (publish through the exchange, lease, close) and the syncer (the exchange's poll);
- ``_ranks.py``: :class:`RankGroup`, a learner made of many ranks (``torch.distributed``,
  DDP): rank 0 alone talks to the mailbox and, after every call, the others receive the
  tensors it replaced (one fixed sequence of collectives); ``RanksFailed`` when a rank died;
- ``_resume.py``: :class:`Resume`, resume saves (``optimizer=``): the optimizer's state
  and the counters stored every few sync points and loaded when the learner restarts;
  ``_optstate.py``: an optimizer's ``state_dict()`` as tagged JSON and tensors (no pickle).

Loading a run's model without joining (:func:`gradientmail.align`) is ``engine/align.py``.
"""

from gradientmail.session.session import Session

__all__ = ["Session"]
