"""Patterns built on the mailbox alone: lining nodes up, and sharing a queue of work.

Files of this package:

- ``barrier.py``: :class:`Barrier`, which holds each node at a named point until a number
  of nodes reached it (spec 000). Arrivals are ``barriers/{name}/{learner_id}``.
- ``shared_queue.py``: :func:`shared_queue` / :class:`SharedQueue`, every node walking the
  same list of work units, each unit claimed by one node with ``put_if_absent`` under
  ``units/`` and done exactly once, with a bounded background prefetch buffer. Its
  docstring holds the key layout and the policy for units of crashed nodes.
- ``_keys.py``: checks for names that become key segments, and for counts and timeouts,
  before any I/O.

Neither depends on :class:`~gradientmail.Session`; both work beside one. Import them from
their modules, as spec 000 does::

    from gradientmail.patterns.barrier import Barrier
    from gradientmail.patterns.shared_queue import shared_queue

(This package does not re-export the function ``shared_queue``: it would hide the module of
the same name.)
"""

from gradientmail.patterns.barrier import Barrier
from gradientmail.patterns.shared_queue import SharedQueue

__all__ = ["Barrier", "SharedQueue"]
