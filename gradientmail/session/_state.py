"""What a learner's threads share, and the small pure rules of their loops.

:class:`Shared` is the state the training thread, the communication thread and the syncer
share, passed to each explicitly (it is the exchange's :class:`~gradientmail.engine.
exchange.Host`): the hand-off (``inflight``, ``outbox``: :class:`~gradientmail.engine.
exchange.Pending` contributions to the communication thread), the ONE staging path
(:meth:`Shared.stage`: ``_Staged`` commits back to the training thread, at most one per
fragment, a newer one merging the older), the counters, the events, and the wakes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from gradientmail import wire as p
from gradientmail.coord.threads import Wake
from gradientmail.engine.exchange import Counter, Pending, mine_of
from gradientmail.events import (
    Counters,
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


@dataclass(eq=False)
class Shared:
    """The state a Session's threads share (module docstring); ``lock`` guards what more
    than one thread touches."""

    learner_id: str
    fragments: int
    on_event: Callable[[Event], None] | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    changed: threading.Event = field(default_factory=threading.Event)  # a commit staged
    stop: threading.Event = field(default_factory=threading.Event)
    counters: Counters = field(default_factory=Counters)
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=1000))
    inflight: dict[int, Pending] = field(default_factory=dict)  # fragment -> contribution
    outbox: deque[Pending] = field(default_factory=deque)  # handed over, not yet published
    staged: dict[int, _Staged] = field(default_factory=dict)
    # Per fragment: the newest commit seen or staged, the parameters of the one applied
    # (the reference), a compressing algorithm's error feedback (replaced when a commit
    # holding this learner's contribution is applied).
    known: list[int] = field(default_factory=list)
    ref: list[dict[str, torch.Tensor]] = field(default_factory=list)
    residual: list[dict[str, torch.Tensor] | None] = field(default_factory=list)
    waiting_since: float | None = None  # when a wait of the training thread began
    wake_sync: Wake = field(default_factory=Wake)  # published or committed: look for commits
    wake_comm: Wake = field(default_factory=Wake)  # step() handed a fragment over
    wake_beat: Wake = field(default_factory=Wake)  # a contribution was published: beat now

    def __post_init__(self) -> None:
        n = self.fragments
        self.known, self.ref, self.residual = [0] * n, [{} for _ in range(n)], [None] * n

    def emit(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)
        self.changed.set()
        _log_event(event)
        if self.on_event is not None:
            with contextlib.suppress(Exception):  # a broken callback must not stop the session
                self.on_event(event)

    def count(self, counter: Counter) -> None:
        with self.lock:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)

    def stage(
        self,
        commit: p.Commit,
        params: dict[str, torch.Tensor],
        mine: frozenset[tuple[int, str]] | None = None,
    ) -> bool:
        """Hand a verified commit to the training thread; False when it is not newer than
        what is already known for its fragment (found meanwhile by the other thread)."""
        fragment = commit.fragment
        if mine is None:
            mine = mine_of([commit], self.learner_id)
        item = _Staged(commit, params, mine)
        with self.lock:
            if commit.round <= self.known[fragment]:
                return False
            older = self.staged.get(fragment)
            self.staged[fragment] = item if older is None else item.merged(older)
            self.known[fragment] = commit.round
        self.changed.set()
        return True

    def wake_syncer(self) -> None:
        self.wake_sync.set()


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
