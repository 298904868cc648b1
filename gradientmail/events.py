"""Events a Session reports, and the counters it keeps.

Events are frozen dataclasses. A Session keeps the most recent ones in ``session.events``
and passes each to its ``on_event`` callback, which runs on a background thread and must
be quick and thread-safe. Background failures never stop a Session: they become
``PollFailed`` / ``PublishFailed`` / ``RoundFailed`` events and the loop goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Applied",
    "Committed",
    "Event",
    "Following",
    "GroupMissed",
    "Joined",
    "Left",
    "PollFailed",
    "PublishFailed",
    "Published",
    "ResumeFailed",
    "ResumeSaved",
    "Resumed",
    "RoundFailed",
    "SyncSkipped",
    "SyncWaited",
]


@dataclass(frozen=True)
class Event:
    learner: str


@dataclass(frozen=True)
class Joined(Event):
    creator: bool
    rounds: tuple[int, ...]  # newest commit of each fragment loaded at join


@dataclass(frozen=True)
class Following(Event):
    """This process is rank ``rank`` (of ``ranks``) of a learner of many ranks, not its
    leader: it never talks to the mailbox, its counters stay at zero, and after every call
    it receives the parameters the leader (rank 0) applied (``session/_ranks.py``)."""

    rank: int
    ranks: int
    rounds: tuple[int, ...]  # the leader's newest commit of each fragment, received at join


@dataclass(frozen=True)
class Published(Event):
    round: int
    fragment: int
    samples: int
    nbytes: int


@dataclass(frozen=True)
class SyncSkipped(Event):
    """A fragment came due while its previous contribution was still in flight."""

    fragment: int
    step: int


@dataclass(frozen=True)
class SyncWaited(Event):
    """``step()`` (or ``sync()`` / ``close()``) held the training thread until a commit of
    ``fragment`` was applied: at a sync point with ``overlap=0``, ``overlap`` steps after
    one, or at the fragment's next sync point. ``timed_out``: it gave up after the bound
    (the contribution stays in flight; training went on)."""

    fragment: int
    round: int
    step: int
    seconds: float
    timed_out: bool


@dataclass(frozen=True)
class Committed(Event):
    """This learner closed a round (or adopted the record another closer wrote first).

    ``excluded``: learners whose snapshot the record lists as excluded (unusable)."""

    round: int
    fragment: int
    contributors: tuple[str, ...]
    adopted: bool
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupMissed(Event):
    """A Moshpit contribution came after its group had closed without it: this learner
    keeps its own parameters and catches up to the newest group round next time."""

    round: int
    group: str


@dataclass(frozen=True)
class Applied(Event):
    round: int
    fragment: int
    contributed: bool
    lag_s: float  # from the sync point (hand-over) to applying its commit (0 if not contributed)


@dataclass(frozen=True)
class Left(Event):
    clean: bool


@dataclass(frozen=True)
class PollFailed(Event):
    error: str


@dataclass(frozen=True)
class PublishFailed(Event):
    round: int
    error: str


@dataclass(frozen=True)
class RoundFailed(Event):
    round: int
    error: str


@dataclass(frozen=True)
class Resumed(Event):
    """A restarted learner (``Session(optimizer=...)``) loaded its optimizer's state and its
    counters from its newest save ``key``, before its first step: its step count continues
    from ``step`` (and ``samples``); ``rounds`` are the commits it had applied when it saved
    (the model holds the run's newest, loaded at join)."""

    key: str
    step: int
    samples: int
    rounds: tuple[int, ...]


@dataclass(frozen=True)
class ResumeFailed(Event):
    """The newest save ``key`` could not be read (corrupt, missing, malformed): the learner
    starts with a fresh optimizer and counts from 0, as on a first start."""

    key: str
    error: str


@dataclass(frozen=True)
class ResumeSaved(Event):
    """The optimizer's state and the counters at ``step`` are stored as ``key`` (a payload
    of ``nbytes`` bytes); older saves of this learner are swept."""

    key: str
    step: int
    nbytes: int


@dataclass
class Counters:
    """Traffic and progress, readable at any time through ``Session.counters()``."""

    requests: dict[str, int] = field(default_factory=dict)  # "put:blobs", "list:rounds", ...
    bytes_up: dict[str, int] = field(default_factory=dict)  # by key kind
    bytes_down: dict[str, int] = field(default_factory=dict)
    published: int = 0
    closed: int = 0
    applied: int = 0
    # Commits this learner computed from their rounds' compressed contributions instead of
    # downloading their parameters (SparseLoCo: algorithms/contribution.py).
    computed: int = 0
    missed_groups: int = 0  # Moshpit: contributions that came after their group closed
    skipped_syncs: int = 0  # sync points passed without contributing (free_running only)
    sync_points: int = 0  # sync points training reached (every fragment's, close()/sync() too)
    waits: int = 0  # times step()/sync()/close() held the training thread for a commit
    waited_s: float = 0.0  # seconds it held it in all
    wait_timeouts: int = 0  # waits that gave up after the bound
    last_inner_steps: int = 0  # local steps the newest contribution covered
    last_commit_lag_s: float | None = None
