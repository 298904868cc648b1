"""The payload worker threads survive a fork: a process forked from one that already
transferred payloads (a test worker, a launcher that synced before starting learners) gets
workers of its own instead of waiting for ever on the parent's, which do not exist in it."""

from __future__ import annotations

import multiprocessing
import threading

from gradientmail.payload import stream


def _fill(count: int) -> None:
    """Run ``count`` tasks at once on the payload workers, so that every worker thread of
    the pool is started (each waits for the others at a barrier; bounded)."""
    meeting = threading.Barrier(count)
    futures = [stream.workers().submit(meeting.wait, 20) for _ in range(count)]
    for future in futures:
        future.result(timeout=30)


def _child(count: int) -> None:
    _fill(count)  # raises (exit status 1) when the pool's workers never run


def test_a_forked_child_gets_payload_workers_of_its_own() -> None:
    count = stream.workers()._max_workers
    _fill(count)  # the parent's pool holds all its threads
    child = multiprocessing.get_context("fork").Process(target=_child, args=(count,))
    child.start()
    child.join(90)
    if child.exitcode is None:
        child.kill()
        child.join(10)
    assert child.exitcode == 0, f"the forked child's transfers hung or failed: {child.exitcode}"
