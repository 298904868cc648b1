"""A learner's records between its threads, and the small pure rules of its loops.

``_Pending`` is a contribution handed from the training thread to the communication
thread; ``_Staged`` a verified commit handed from the background threads back to the
training thread (at most one per fragment: a newer one merges the older).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass, field, replace

import torch

from gradientmail import wire as p
from gradientmail.events import (
    Event,
    GroupMissed,
    Joined,
    Left,
    PollFailed,
    PublishFailed,
    Resumed,
    ResumeFailed,
    RoundFailed,
    SyncSkipped,
    SyncWaited,
)

_log = logging.getLogger("gradientmail")

_TICK = 0.02  # how often the communication thread looks for work handed over by step()
_FIRST_POLL = 0.025  # the syncer's first look for a commit after this learner published
# While a commit is awaited, the syncer looks again after this fraction of the time waited so
# far (at least _FIRST_POLL, at most poll_interval): a commit that lands t seconds after the
# publish is seen at most t/8 late, for about 8 lists per doubling of the wait. Doubling
# intervals, as before, saw a commit that landed just after the 375 ms look only at 775 ms.
_POLL_FRACTION = 0.125


def _poll_delay(waited: float, poll_interval: float) -> float:
    """Seconds until the syncer's next look for a commit it waits for, ``waited`` seconds
    after this learner published."""
    return min(poll_interval, max(_FIRST_POLL, waited * _POLL_FRACTION))


def _default_learner_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()) or "host"
    return p.check_learner_id(f"{host[:100]}-{os.getpid()}")


@dataclass(eq=False)
class _Pending:
    """A contribution from the training thread: fragment copy, samples, round."""

    round: int
    fragment: int
    base: int
    snapshot: dict[str, torch.Tensor]
    base_params: dict[str, torch.Tensor]
    samples: int
    step: int  # the local step at which it was handed over
    handed_at: float = field(default_factory=time.monotonic)  # when (the sync point)
    # Training thread only: a wait for its commit gave up; the next wait for it is at the
    # fragment's next sync point, not at every step until then.
    gave_up: bool = False
    payload: str | None = None
    published_at: float | None = None
    cancelled: bool = False
    # A compressing algorithm's (algorithms/contribution.py), set by the communication
    # thread when it encodes: the payload's tensors (a closer sums its own from these), and
    # the error feedback this learner keeps once the contribution is in a commit.
    compressed: dict[str, torch.Tensor] | None = None
    residual: dict[str, torch.Tensor] | None = None
    group: str | None = None  # Moshpit: the group it was published to (round: its round)


@dataclass(frozen=True)
class _Staged:
    commit: p.Commit
    params: dict[str, torch.Tensor]
    mine: frozenset[tuple[int, str]] = field(default_factory=frozenset)  # (round, payload)

    def merged(self, older: _Staged) -> _Staged:
        """This (newer) commit of a fragment, remembering which of ``older``'s rounds held
        this learner's contributions: applying the newest alone is enough, its parameters
        are complete, but the anchor of the rebase depends on whether we contributed."""
        return replace(self, mine=self.mine | older.mine)


def _log_event(event: Event) -> None:
    """Every event to the ``gradientmail`` logger: failures at WARNING (with the cause),
    joins, leaves, resumes and waits that gave up at INFO, the rest at DEBUG."""
    if isinstance(event, PollFailed | PublishFailed | RoundFailed):
        _log.warning("%s: %s", event.learner, event)
    elif isinstance(event, ResumeFailed):
        _log.warning("%s: could not resume from %s (%s)", event.learner, event.key, event.error)
    elif isinstance(event, Resumed):
        _log.info(
            "%s: resumed from %s: optimizer state and counters at step %d (%d samples), "
            "saved with rounds %s applied",
            event.learner,
            event.key,
            event.step,
            event.samples,
            list(event.rounds),
        )
    elif isinstance(event, SyncWaited) and event.timed_out:
        _log.warning(
            "%s: waited %.1f s for round %d (fragment %d) and gave up; training goes on",
            event.learner,
            event.seconds,
            event.round,
            event.fragment,
        )
    elif isinstance(event, Joined | Left):
        _log.info("%s: %s", event.learner, event)
    elif isinstance(event, SyncSkipped | GroupMissed):
        _log.info("%s: skipped a sync point: %s", event.learner, event)
    else:  # Published, Committed, Applied, SyncWaited within its bound
        _log.debug("%s: %s", event.learner, event)
