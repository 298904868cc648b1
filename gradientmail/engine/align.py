"""The run's aligned model, read without joining: one implementation for ``gm.align``,
``gradientmail align`` and a joining Session's load.

- :func:`load_newest`: the newest readable commit of every fragment (a run-wide round
  exchange); the newest rounds come from :func:`gradientmail.coord.sweep.newest_per_fragment`.
- :func:`aligned`: a Moshpit run's newest group round, averaged (or the parameters its
  groups share); :func:`describe_alignment` says which in words.
- :func:`read_aligned`: either, chosen by the run's exchange (``settings.exchange_kind``),
  loaded into a :class:`~gradientmail.engine.layout.ModelLayout` (a model's, or one made
  from the manifest alone: ``ModelLayout.from_manifest``), listing again when a live run's
  sweep took what was listed (:class:`~gradientmail.errors.ObjectMissing`).
- :func:`align`: ``gm.align``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm, from_manifest
from gradientmail.algorithms.moshpit import Moshpit
from gradientmail.coord.retry import retrying
from gradientmail.coord.sweep import newest_per_fragment, round_numbers
from gradientmail.coord.threads import run_coroutine
from gradientmail.engine.chain import commit_tensors
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ObjectMissing, PayloadCorrupt, ProtocolError, RoundMissing
from gradientmail.ledger import GLOBAL
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors
from gradientmail.settings import exchange_kind

__all__ = [
    "Aligned",
    "align",
    "aligned",
    "describe_alignment",
    "download_average",
    "load_newest",
    "newest_group_round",
    "newest_per_fragment",
    "read_aligned",
    "wait_for",
]

_log = logging.getLogger("gradientmail")
_FALLBACK = 8  # older commits of a fragment tried when its newest cannot be loaded
_ATTEMPTS = 3  # listings tried when a live run's sweep takes what the previous one listed
_POLL = 0.2  # seconds between two looks for an object that is not there yet


# -- run-wide rounds -------------------------------------------------------------------------


async def wait_for(
    box: Mailbox,
    key: str,
    deadline: float,
    what: str,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bytes:
    """``key``'s bytes once it exists (the manifest, an initial commit), polling every
    ``_POLL`` seconds; ``TimeoutError`` naming ``what`` and ``key`` after ``deadline``."""
    while True:
        data = await retrying(lambda: box.get(key), deadline=deadline, clock=clock, sleep=sleep)
        if data is not None:
            return data
        if clock() > deadline:
            raise TimeoutError(f"{what}: {key} did not appear in time")
        await sleep(_POLL)


async def load_newest(
    box: Mailbox,
    layout: ModelLayout,
    deadline: float | None = None,
    *,
    algorithm: Algorithm | None = None,
) -> tuple[dict[int, int], dict[int, dict[str, torch.Tensor]]]:
    """Download the newest readable commit of every fragment (computed along its chain when
    its parameters are not stored: ``engine/chain.py``); return rounds and verified
    tensors. A newest record that cannot be read (truncated, malformed) is reported and the
    one before it is used: one bad object must not keep every joiner (and align) out.
    ``algorithm``: the run's (default: read from its manifest when a commit's parameters
    must be computed). Raises :class:`RoundMissing` when a fragment has no commit yet, and
    :class:`ObjectMissing` when every commit tried of a fragment lacked an object (a live
    run swept them since the listing: list again)."""
    keys = await retrying(lambda: box.list(p.ROUNDS), deadline=deadline)
    by_fragment: dict[int, list[int]] = {}
    for r in round_numbers(keys):
        by_fragment.setdefault(r % layout.count, []).append(r)
    missing = [f for f in range(layout.count) if f not in by_fragment]
    if missing:
        raise RoundMissing(f"fragments {missing} have no commit yet; has the run been created?")
    newest: dict[int, int] = {}
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for fragment, rounds in sorted(by_fragment.items()):
        failures: list[ProtocolError] = []
        for r in reversed(rounds[-_FALLBACK:]):
            key = p.round_key(r)
            try:
                data = await retrying(partial(box.get, key), deadline=deadline)
                commit = p.decode_commit(key, data)
                if algorithm is None and not commit.stored:
                    data = await retrying(partial(box.get, p.MANIFEST), deadline=deadline)
                    algorithm = from_manifest(p.decode_manifest(p.MANIFEST, data).algorithm)
                values = await commit_tensors(
                    box,
                    algorithm,
                    layout.specs[fragment],
                    commit,
                    purpose=GLOBAL,
                    deadline=deadline,
                )
            except (ProtocolError, PayloadCorrupt) as exc:
                _log.warning("%s cannot be loaded (%s); trying the commit before it", key, exc)
                failures.append(exc)
                continue
            newest[fragment], tensors[fragment] = r, values
            break
        else:
            gone = all(isinstance(exc, ObjectMissing) for exc in failures)
            raise (ObjectMissing if gone else ProtocolError)(
                f"fragment {fragment}: none of its newest {len(failures)} commits can be "
                "loaded: " + "; ".join(str(exc) for exc in failures)
            )
    return newest, tensors


# -- Moshpit group rounds ----------------------------------------------------------------------


async def newest_group_round(box: Mailbox) -> list[p.Commit]:
    """The commits of the newest group round that has any (empty when none)."""
    keys = await retrying(partial(box.list, p.GROUP_ROUNDS))
    rounds = sorted({t for t in map(p.group_round_of, keys) if t is not None})
    for t in reversed(rounds[-4:]):
        commits = []
        for key in (k for k in keys if p.group_round_of(k) == t):
            data = await retrying(partial(box.get, key))
            if data is None:
                continue
            with contextlib.suppress(ProtocolError):
                commits.append(p.decode_commit(key, data))
        if commits:
            return commits
    return []


async def download_average(
    box: Mailbox, algorithm: Moshpit, layout: ModelLayout, commits: Sequence[p.Commit]
) -> dict[str, torch.Tensor]:
    """The sample-weighted average of group commits' parameters (``align``'s and a late
    joiner's model): each commit weighs as the samples of its members."""
    # engine.groups re-exports this module's names: imported here, not at the top.
    from gradientmail.engine.groups import average_of

    members = [
        p.Snapshot(c.round, f"g{i:04d}", max(1, c.samples), c.params, 0)
        for i, c in enumerate(sorted(commits, key=lambda c: c.group or ""))
    ]
    if len(members) == 1:
        return await retrying(partial(get_tensors, box, members[0].payload, layout.specs[0]))
    params, _, excluded = await average_of(box, algorithm, layout, members, None)
    if excluded:
        bad = excluded[0]
        # Gone (a live run swept that round since the listing), or there and unreadable.
        gone = not await retrying(partial(box.list, bad.key))
        raise (ObjectMissing if gone else ProtocolError)(
            "a group commit's payload cannot be read: " + bad.reason
        )
    return params


def describe_alignment(commits: Sequence[p.Commit]) -> str:
    """What :func:`aligned` loads from ``commits`` (one group round's), in words."""
    if not commits:
        return "the initial commit (no group round has committed yet)"
    t = commits[0].round
    members = sum(len(c.contributors) for c in commits)
    if len({c.params for c in commits}) == 1:
        return (
            f"group round {t}'s commit, which all its {len(commits)} groups ({members} "
            "learners) share: the global average"
        )
    return (
        f"the sample-weighted average of group round {t}'s {len(commits)} group commits "
        f"({members} learners)"
    )


async def aligned(
    box: Mailbox, algorithm: Moshpit, layout: ModelLayout
) -> tuple[list[p.Commit], dict[str, torch.Tensor] | None]:
    """A Moshpit run's aligned model: the newest group round's commits and their
    sample-weighted average, or their shared parameters when every group of the round
    committed the same (the grid has averaged everyone: the global average, loaded as it
    is); ``([], None)`` before the first group round."""
    commits = await newest_group_round(box)
    if not commits:
        return [], None
    if len({c.params for c in commits}) == 1:
        params = await retrying(partial(get_tensors, box, commits[0].params, layout.specs[0]))
        return commits, params
    return commits, await download_average(box, algorithm, layout, commits)


# -- either, into a layout -----------------------------------------------------------------------


@dataclass(frozen=True)
class Aligned:
    """What :func:`read_aligned` loaded: ``{fragment: round}`` (a Moshpit run's ``{0: group
    round}``) and, for a Moshpit run, which commits in words and the groups whose commits
    were loaded (none before its first group round)."""

    rounds: dict[int, int]
    description: str | None = None
    groups: tuple[str, ...] = ()


async def read_aligned(
    box: Mailbox, manifest: p.Manifest, layout: ModelLayout, deadline: float | None = None
) -> Aligned:
    """Load the run's aligned model into ``layout`` (the run's frozen parameters too).

    Run-wide rounds: the newest readable commit of every fragment (:func:`load_newest`). A
    Moshpit run: its newest group round's commits (:func:`aligned`), or its initial commit
    before the first group round. A live run's sweep may take what was just listed: the
    listing is read again, up to three times (:class:`ObjectMissing`). Raises
    :class:`RoundMissing` before the run's initial commits exist."""
    algorithm = from_manifest(manifest.algorithm)  # settings this release understands
    if manifest.frozen_payload is not None:
        frozen = await retrying(
            partial(get_tensors, box, manifest.frozen_payload, manifest.frozen), deadline=deadline
        )
        layout.load_frozen(frozen)
    groups = exchange_kind(manifest.algorithm.get("name")) == "groups"
    if groups and not isinstance(algorithm, Moshpit):  # pragma: no cover - registry says so
        raise ProtocolError(f"the run's algorithm {manifest.algorithm!r} exchanges no groups")
    for attempt in range(_ATTEMPTS):
        try:
            if isinstance(algorithm, Moshpit) and groups:
                commits, params = await aligned(box, algorithm, layout)
                if params is not None:
                    layout.load(0, params)
                    names = tuple(sorted(c.group or "" for c in commits))
                    return Aligned({0: commits[0].round}, describe_alignment(commits), names)
            rounds, tensors = await load_newest(box, layout, deadline, algorithm=algorithm)
        except ObjectMissing as exc:
            if attempt == _ATTEMPTS - 1:
                raise
            _log.info("align: %s; listing again (swept by the live run)", exc)
            continue
        for fragment, values in tensors.items():
            layout.load(fragment, values)
        return Aligned(rounds, describe_alignment([]) if groups else None)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _align(model: torch.nn.Module, box: Mailbox, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    manifest_bytes = await wait_for(box, p.MANIFEST, deadline, "align")
    manifest = p.decode_manifest(p.MANIFEST, manifest_bytes)
    layout = ModelLayout.for_run(model, manifest)  # ProtocolError naming any difference
    loaded = await read_aligned(box, manifest, layout, deadline)
    if loaded.description is not None:
        _log.info("align: loaded %s", loaded.description)
    return loaded.rounds


def align(model: torch.nn.Module, *, mailbox: Mailbox, timeout: float = 60.0) -> dict[int, int]:
    """Load the run's newest committed parameters into ``model`` without joining.

    Returns ``{fragment: round}`` of the commits loaded. For evaluation, or to start a new
    process from the run's current state. Each tensor gets the model's own dtype: a
    commit's float32 global rounded by ``Tensor.to`` (round to nearest, ties to even), what
    a learner of that dtype loads. A Moshpit run has no run-wide commits: its
    newest group round's commits are averaged (sample-weighted), or loaded as they are when
    they all hold the same parameters; the log says which (``{0: group round}``).
    """
    return run_coroutine(_align(model, mailbox, timeout))
