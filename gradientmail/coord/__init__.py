"""Coordination through create-once writes, with no torch: what every pattern shares.

- ``retry.py``: retrying transient store failures with jittered, capped backoff.
- ``leases.py``: liveness from heartbeat keys, judged on the observer's own clock.
- ``heartbeat.py``: renewing a lease (a Session's, a Shared Queue's) as a task of its own.
- ``election.py``: claim-with-failover: when a claim may be taken over, claiming once.
- ``sweep.py``: deleting what no kept commit needs, idempotent, caught up by the next commit.
- ``threads.py``: running coroutines from synchronous code; waking a loop from a thread.
"""
