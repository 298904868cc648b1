"""Every key of the round protocol: its layout, builders and parsers (no I/O, no torch).

Every object is created once with ``put_if_absent``; numbers in keys have a fixed width, so
byte order is numeric order. No server clock is used anywhere.

==================================  ==============  ===========================================
key                                 written by      holds
==================================  ==============  ===========================================
``claims/creator``                  first node      CreatorClaim: elects the creator
``claims/creator-{attempt:04d}``    joiner          a later creator claim (the holder died)
``manifest.json``                   creator         Manifest: format, algorithm, layout
``rounds/{r:010d}``                 round closer    Commit: the round's result
``snapshots/{r:010d}/{learner}``    learner         Snapshot: a contribution to round r
``claims/{r:010d}/{attempt:04d}``   closer          Claim: elects round r's closer
``claims/{r:010d}/failed``          closer          RoundFailure: round r cannot be made by
                                                    anyone (a fault in the run's data); every
                                                    learner in it raises the reason
``leases/{learner}/{beat:010d}``    learner         Beat: heartbeat; newest key wins
``resume/{learner}/{save:010d}``    learner         ResumeState: its optimizer state and
                                                    counters (``Session(optimizer=...)``)
``blobs/{sha256}``                  anyone          safetensors bytes named by their hash
``blobs/{sha256}.parts``            anyone          index of a payload stored in parts
``grid/{slot:06d}``                 Moshpit learner Claim: its slot, hence its first grid cell
``group-rounds/{t:010d}/{group}``   group closer    Commit: a Moshpit group's average
``group-snapshots/{t:010d}/{group}/{learner}``
                                    learner         Snapshot: its parameters for group round t
``group-claims/{t:010d}/{group}/{attempt:04d}``
                                    group closer    Claim: elects the group's closer
``barriers/{name}/{learner}``       Barrier         arrival (patterns)
``units/{id}``                      Shared Queue    first claim of a unit (patterns)
``units-reclaims/{id}/{attempt}``   Shared Queue    later claims of an abandoned unit
``units-done/{id}``                 Shared Queue    the unit was consumed completely
``units-leases/{learner}/{beat}``   Shared Queue    the queue's own lease (same rules)
==================================  ==============  ===========================================

A Moshpit run (``algorithms/moshpit.py``) keeps only its initial commit under ``rounds/``;
its group rounds ``t >= 1`` are numbered apart, one group per line of the grid
(``{group}``: the other coordinates, three digits each, the active one ``x``).

Rounds form one monotone sequence. With ``P`` fragments, round ``r`` carries fragment
``r % P``; rounds ``0 .. P-1`` hold the initial parameters (no contributors), so every
node starts from identical values, and round ``r >= P`` is based on round ``r - P``.
"""

from __future__ import annotations

import re

from gradientmail.errors import ProtocolError

FORMAT_VERSION = 1

CREATOR = "claims/creator"
MANIFEST = "manifest.json"
ROUNDS = "rounds/"
SNAPSHOTS = "snapshots/"
CLAIMS = "claims/"
LEASES = "leases/"
BLOBS = "blobs/"
RESUME = "resume/"
GRID = "grid/"
GROUP_ROUNDS = "group-rounds/"
GROUP_SNAPSHOTS = "group-snapshots/"
GROUP_CLAIMS = "group-claims/"

_ROUND_WIDTH = 10
_ATTEMPT_WIDTH = 4
_LEARNER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_SLOT_WIDTH = 6
_GROUP_RE = re.compile(r"(x|[0-9]{3})(-(x|[0-9]{3})){0,7}")


def check_learner_id(learner_id: object) -> str:
    """Return ``learner_id`` if it can be a key segment, else raise ``ValueError``."""
    if not isinstance(learner_id, str) or not _LEARNER_RE.fullmatch(learner_id):
        raise ValueError(
            f"learner_id {learner_id!r} is not a valid key segment: use 1-128 characters "
            "from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return learner_id


def round_key(r: int) -> str:
    return f"{ROUNDS}{r:0{_ROUND_WIDTH}d}"


def parse_round_key(key: str) -> int:
    tail = key.removeprefix(ROUNDS)
    if tail == key or len(tail) != _ROUND_WIDTH or not tail.isdigit():
        raise ProtocolError(f"{key!r} is not a round key (rounds/ and {_ROUND_WIDTH} digits)")
    return int(tail)


def snapshots_prefix(r: int) -> str:
    return f"{SNAPSHOTS}{r:0{_ROUND_WIDTH}d}/"


def snapshot_key(r: int, learner: str) -> str:
    return f"{snapshots_prefix(r)}{learner}"


def claims_prefix(r: int) -> str:
    return f"{CLAIMS}{r:0{_ROUND_WIDTH}d}/"


def claim_key(r: int, attempt: int) -> str:
    return f"{claims_prefix(r)}{attempt:0{_ATTEMPT_WIDTH}d}"


def failure_key(r: int) -> str:
    """Round ``r``'s failure record: beside its claims, so a closer's listing of them finds
    it without another request (``claim_round`` is None for it: no claim attempt)."""
    return f"{claims_prefix(r)}failed"


def parse_claim_attempt(key: str) -> int:
    tail = key.rpartition("/")[2]
    if len(tail) != _ATTEMPT_WIDTH or not tail.isdigit():
        raise ProtocolError(f"{key!r} is not a claim key")
    return int(tail)


def creator_key(attempt: int) -> str:
    """Creator claim ``attempt``: ``claims/creator`` for 0 (what every release reads), then
    ``claims/creator-0001``... A sibling, never a child: ``claims/creator`` is a key, so it
    cannot also be a directory (spec 004). Byte order is attempt order."""
    if attempt < 0 or attempt >= 10**_ATTEMPT_WIDTH:
        raise ValueError(f"creator claim attempt {attempt} is out of range")
    return CREATOR if attempt == 0 else f"{CREATOR}-{attempt:0{_ATTEMPT_WIDTH}d}"


def parse_creator_attempt(key: str) -> int:
    """``claims/creator`` → 0, ``claims/creator-{attempt:04d}`` → attempt."""
    if key == CREATOR:
        return 0
    tail = key.removeprefix(f"{CREATOR}-")
    if tail == key or len(tail) != _ATTEMPT_WIDTH or not tail.isdigit() or int(tail) == 0:
        raise ProtocolError(f"{key!r} is not a creator claim key")
    return int(tail)


def claim_round(key: str) -> int | None:
    """``claims/{round}/{attempt}`` -> round; None for any other key under ``claims/``."""
    parts = key.split("/")
    if (
        len(parts) == 3
        and parts[0] == CLAIMS.rstrip("/")
        and len(parts[1]) == len(claims_prefix(0)) - len(CLAIMS) - 1
        and parts[1].isdigit()
        and parts[2].isdigit()
        and key == claim_key(int(parts[1]), int(parts[2]))
    ):
        return int(parts[1])
    return None


def lease_prefix(learner: str) -> str:
    return f"{LEASES}{learner}/"


LEAVING_BEAT = 10**_ROUND_WIDTH - 1
"""A learner that leaves writes this beat number last: observers drop it at once."""


def beat_key(learner: str, beat: int) -> str:
    return f"{lease_prefix(learner)}{beat:0{_ROUND_WIDTH}d}"


def parse_beat_key(key: str) -> tuple[str, int]:
    """``leases/{learner}/{beat}`` → (learner, beat)."""
    parts = key.split("/")
    if (
        len(parts) != 3
        or parts[0] != LEASES.rstrip("/")
        or len(parts[2]) != _ROUND_WIDTH
        or not parts[2].isdigit()
        or not _LEARNER_RE.fullmatch(parts[1])
    ):
        raise ProtocolError(f"{key!r} is not a lease beat key")
    return parts[1], int(parts[2])


def parse_snapshot_key(key: str) -> tuple[int, str]:
    """``snapshots/{round}/{learner}`` → (round, learner)."""
    parts = key.split("/")
    if (
        len(parts) != 3
        or parts[0] != SNAPSHOTS.rstrip("/")
        or len(parts[1]) != _ROUND_WIDTH
        or not parts[1].isdigit()
        or not _LEARNER_RE.fullmatch(parts[2])
    ):
        raise ProtocolError(f"{key!r} is not a snapshot key")
    return int(parts[1]), parts[2]


def resume_prefix(learner: str) -> str:
    """Where ``learner`` keeps what a restart of it resumes from (``Session(optimizer=...)``):
    one record per save, numbered from 0 in the order they were taken. Only the learner
    itself writes here, and its newest save is the one a restart reads; older ones are
    swept once a newer one is written (``coord/sweep.py``)."""
    return f"{RESUME}{learner}/"


def resume_key(learner: str, save: int) -> str:
    """The record of ``learner``'s save number ``save``: fixed width, so the newest save is
    the greatest key (a listing's last), and a crashed life's saves sort before the next
    life's (a restart numbers on from the newest it finds)."""
    if save < 0 or save >= 10**_ROUND_WIDTH:
        raise ValueError(f"resume save number {save} is out of range")
    return f"{resume_prefix(learner)}{save:0{_ROUND_WIDTH}d}"


def parse_resume_key(key: str) -> tuple[str, int]:
    """``resume/{learner}/{save}`` → (learner, save)."""
    parts = key.split("/")
    if (
        len(parts) != 3
        or parts[0] != RESUME.rstrip("/")
        or len(parts[2]) != _ROUND_WIDTH
        or not parts[2].isdigit()
        or not _LEARNER_RE.fullmatch(parts[1])
    ):
        raise ProtocolError(f"{key!r} is not a resume key")
    return parts[1], int(parts[2])


# -- Moshpit groups ------------------------------------------------------------------------


def grid_key(slot: int) -> str:
    if slot < 0 or slot >= 10**_SLOT_WIDTH:
        raise ValueError(f"grid slot {slot} is out of range")
    return f"{GRID}{slot:0{_SLOT_WIDTH}d}"


def parse_grid_key(key: str) -> int:
    tail = key.removeprefix(GRID)
    if tail == key or len(tail) != _SLOT_WIDTH or not tail.isdigit():
        raise ProtocolError(f"{key!r} is not a grid slot key (grid/ and {_SLOT_WIDTH} digits)")
    return int(tail)


def check_group(group: str) -> str:
    """Return ``group`` if it is a group name (``003-x-001``), else raise ``ProtocolError``."""
    if not _GROUP_RE.fullmatch(group) or group.count("x") != 1:
        raise ProtocolError(f"{group!r} is not a group name (three-digit coordinates and one x)")
    return group


def group_round_prefix(t: int) -> str:
    return f"{GROUP_ROUNDS}{t:0{_ROUND_WIDTH}d}/"


def group_round_key(t: int, group: str) -> str:
    return f"{group_round_prefix(t)}{check_group(group)}"


def parse_group_round_key(key: str) -> tuple[int, str]:
    """``group-rounds/{t}/{group}`` → (t, group)."""
    parts = key.split("/")
    if (
        len(parts) != 3
        or parts[0] != GROUP_ROUNDS.rstrip("/")
        or len(parts[1]) != _ROUND_WIDTH
        or not parts[1].isdigit()
        or int(parts[1]) < 1
    ):
        raise ProtocolError(f"{key!r} is not a group round key")
    return int(parts[1]), check_group(parts[2])


def group_snapshots_prefix(t: int, group: str | None = None) -> str:
    head = f"{GROUP_SNAPSHOTS}{t:0{_ROUND_WIDTH}d}/"
    return head if group is None else f"{head}{check_group(group)}/"


def group_snapshot_key(t: int, group: str, learner: str) -> str:
    return f"{group_snapshots_prefix(t, group)}{learner}"


def parse_group_snapshot_key(key: str) -> tuple[int, str, str]:
    """``group-snapshots/{t}/{group}/{learner}`` → (t, group, learner)."""
    parts = key.split("/")
    if (
        len(parts) != 4
        or parts[0] != GROUP_SNAPSHOTS.rstrip("/")
        or len(parts[1]) != _ROUND_WIDTH
        or not parts[1].isdigit()
        or not _LEARNER_RE.fullmatch(parts[3])
    ):
        raise ProtocolError(f"{key!r} is not a group snapshot key")
    return int(parts[1]), check_group(parts[2]), parts[3]


def group_claims_prefix(t: int, group: str | None = None) -> str:
    head = f"{GROUP_CLAIMS}{t:0{_ROUND_WIDTH}d}/"
    return head if group is None else f"{head}{check_group(group)}/"


def group_claim_key(t: int, group: str, attempt: int) -> str:
    if attempt < 0 or attempt >= 10**_ATTEMPT_WIDTH:
        raise ValueError(f"group claim attempt {attempt} is out of range")
    return f"{group_claims_prefix(t, group)}{attempt:0{_ATTEMPT_WIDTH}d}"


def group_round_of(key: str) -> int | None:
    """The group round a ``group-*`` key belongs to (None for any other key)."""
    for prefix in (GROUP_ROUNDS, GROUP_SNAPSHOTS, GROUP_CLAIMS):
        if key.startswith(prefix):
            head = key[len(prefix) : len(prefix) + _ROUND_WIDTH]
            if len(head) == _ROUND_WIDTH and head.isdigit():
                return int(head)
    return None


# A payload stored as parts: this blob is its index (see payload/transfer.py).
PARTS_SUFFIX = ".parts"


def blob_key(sha256_hex: str) -> str:
    return f"{BLOBS}{sha256_hex}"


def parts_key(sha256_hex: str) -> str:
    """The key of a part index: the sha256 of the index's own bytes, and the suffix that
    tells readers (and sweepers) to follow it to the parts it names."""
    return f"{BLOBS}{sha256_hex}{PARTS_SUFFIX}"


def is_parts_key(key: str) -> bool:
    return key.startswith(BLOBS) and key.endswith(PARTS_SUFFIX)


def blob_sha(key: str) -> str:
    """The sha256 a blob key names: of the payload's bytes, or of its part index's bytes."""
    sha = key.removeprefix(BLOBS).removesuffix(PARTS_SUFFIX)
    if not key.startswith(BLOBS) or not _SHA_RE.fullmatch(sha):
        raise ProtocolError(
            f"{key!r} is not a blob key (blobs/, a sha256 hex digest, optionally {PARTS_SUFFIX})"
        )
    return sha
