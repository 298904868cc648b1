"""Keeping glibc's per-thread arenas from multiplying a learner's memory (glibc only).

Payload parts (16 MiB) sit below glibc's dynamic mmap threshold once one has been freed,
so each is served from the arena of the thread that allocates it, and stays there when
freed. A learner's transfers run on several threads (the communication and syncer loops,
the payload workers, the store client's); with an arena each, every thread kept its own
freed parts, and a learner's resident memory grew by several hundred megabytes beyond
what it held (measured by ``bench/memory.py``: 25M parameters, 2 learners, 0.87 GiB of
overhead, of which the library held 0.57).

:func:`share_arenas` caps the number of arenas at one (``mallopt(M_ARENA_MAX, 1)``) when
the first Session starts, unless ``MALLOC_ARENA_MAX`` is set in the environment (then the
user's choice stands): threads created from then on share the main arena, so a part freed
by one thread is reused by the next that needs one. Elsewhere (musl, macOS) it does
nothing. Threads that had an arena before keep it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

__all__ = ["share_arenas"]

_log = logging.getLogger("gradientmail")
_M_ARENA_MAX = -8  # glibc's malloc.h
_done = False
_lock = threading.Lock()


def share_arenas() -> bool:
    """Cap glibc's arenas at one for threads created from now on; True when it did."""
    global _done
    with _lock:
        if _done:
            return False
        _done = True
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_ARENA_MAX, 1) != 1:
        return False
    _log.debug("glibc arenas capped at one (set MALLOC_ARENA_MAX to choose otherwise)")
    return True
