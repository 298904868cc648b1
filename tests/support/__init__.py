"""Helpers only the tests use (what ``bench/`` needs too lives in ``testbed/``).

Files:

``waiting.py``       ``wait_until``: wait for a condition, bounded in time (never a bare sleep)
``fault_learner.py`` one learner of the fault suite as a real process, and its fork server
``schedule.py``      how ``scripts/test.sh`` spreads the suite over pytest-xdist workers
``durations.json``   measured test times ``schedule.py`` orders by (longest first)
``s3servers.py`` ``processes.py``   temporary aliases of their ``testbed/`` modules
"""
