"""Coordination through create-once writes, with no torch: what every pattern shares.

- ``retry.py``: retrying transient store failures with jittered, capped backoff.
- ``leases.py``: liveness from heartbeat keys, judged on the observer's own clock.
- ``heartbeat.py``: renewing a lease (a Session's, a Shared Queue's) as a task of its own.
- ``election.py``: claim-with-failover: when a claim may be taken over, who holds one.
- ``claims.py``: the one claim-with-failover loop (:class:`ClaimSeries`): round and group
  closers, the creator, Shared Queue units.
- ``sweep.py``: deleting what no kept commit needs, idempotent, caught up by the next commit;
  the one planner of which rounds are newest and which are old (closers, group closers,
  ``gradientmail sweep``, ``align``).
- ``threads.py``: running coroutines from synchronous code; waking a loop from a thread.
"""
