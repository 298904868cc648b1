"""``gradientmail sweep`` and ``gradientmail rm``: deleting, always after a confirmation.

``sweep`` deletes what the protocol's own sweep (``RoundCloser.sweep``) would have by now,
for a run whose nodes did not (they crashed, or ran with a large ``keep_rounds``): for each
fragment, the snapshots, closer claims and payloads of rounds at least ``keep_rounds``
commits behind its newest, except payloads a kept commit or snapshot still names; and
every learner's beats but the newest two. Round records (``rounds/``) stay: they are the
run's history and small. It is safe beside live nodes (what it deletes only gets older);
``--orphans`` also deletes payloads no kept record names, which is only safe when no node
is running (a node uploads a payload before the record that names it).

For a Moshpit run (``algorithms/moshpit.py``) it also deletes the group rounds older than
the newest ``keep_rounds`` that have commits, whole, as the learners' own sweep does
(``GroupRounds.sweep`` in ``engine/groups.py``): their group commits, snapshots and closer
claims, and the payloads that no kept record names.

``rm`` deletes every object under the URL's prefix.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rich.table import Table

from gradientmail import wire as p
from gradientmail.cli._common import (
    USAGE,
    CliError,
    batches,
    confirm,
    err,
    mailbox_for,
    out,
    plain,
    progress,
    require_manifest,
    run_async,
    store_error,
)
from gradientmail.coord.sweep import (
    group_horizon,
    is_old,
    kept_rounds,
    named_payloads,
    newest_per_fragment,
)
from gradientmail.errors import MailboxError, ProtocolError
from gradientmail.inspect import is_moshpit
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.settings import dense_every
from gradientmail.wire.parts import blob_keys as payload_blobs

__all__ = ["SweepPlan", "add_parsers", "plan_sweep", "run_rm", "run_sweep"]

_READ_BATCH = 64
_DELETE_BATCH = 500


def add_parsers(sub: Any) -> None:
    sweep = sub.add_parser(
        "sweep",
        help="delete old snapshots, claims, payloads and beats of a run (asks first)",
        description=plain(__doc__.split("\n\n")[1]),
    )
    sweep.add_argument("url", help="the run's mailbox URL")
    sweep.add_argument(
        "--keep-rounds",
        type=int,
        default=2,
        help="commits of each fragment whose inputs stay (2, the Session default); of a "
        "Moshpit run, also the group rounds that stay whole",
    )
    sweep.add_argument(
        "--orphans",
        action="store_true",
        help="also delete payloads no kept record names (only when no node is running)",
    )
    sweep.add_argument("-y", "--yes", action="store_true", help="do not ask")
    rm = sub.add_parser(
        "rm",
        help="delete everything under a mailbox URL (asks first)",
        description="Delete every object under the URL's prefix: the whole run. Asks "
        "first, showing how many objects; a prefix that holds no GradientMail run also "
        "needs --force with --yes.",
    )
    rm.add_argument("url", help="the mailbox URL whose prefix to empty")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask")
    rm.add_argument(
        "--force",
        action="store_true",
        help="with --yes: delete even a prefix that holds no GradientMail run, or a whole bucket",
    )


async def _delete(box: Mailbox, keys: Sequence[str]) -> None:
    with progress("deleting", len(keys)) as advance:
        for batch in batches(keys, _DELETE_BATCH):
            await box.delete(batch)
            advance(len(batch))


async def _read(box: Mailbox, keys: Sequence[str]) -> dict[str, bytes | None]:
    found: dict[str, bytes | None] = {}
    with progress("reading records", len(keys)) as advance:
        for batch in batches(keys, _READ_BATCH):
            values = await asyncio.gather(*(box.get(key) for key in batch))
            found.update(zip(batch, values, strict=True))
            advance(len(batch))
    return found


# -- sweep ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepPlan:
    keep_rounds: int
    newest: dict[int, int]  # fragment -> newest committed round
    snapshots: list[str] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)
    beats: list[str] = field(default_factory=list)
    # A Moshpit run's group rounds: the newest with a commit (None: another run, or no group
    # round yet), and the objects of the older ones to delete.
    newest_group_round: int | None = None
    group_records: list[str] = field(default_factory=list)
    group_snapshots: list[str] = field(default_factory=list)
    group_claims: list[str] = field(default_factory=list)

    def keys(self) -> list[str]:
        """Every key to delete, in the order to delete them: payloads (``blobs/`` sorts
        first) and the rest, then a Moshpit run's group snapshots, group commits and group
        claims last, the order the learners' own sweep keeps (``GroupRounds.sweep``)."""
        rest = sorted({*self.snapshots, *self.claims, *self.payloads, *self.beats})
        return [*rest, *self.group_snapshots, *self.group_records, *self.group_claims]

    @property
    def swept_group_rounds(self) -> list[int]:
        """The group rounds this plan deletes objects of."""
        found = map(
            p.group_round_of, (*self.group_records, *self.group_snapshots, *self.group_claims)
        )
        return sorted({t for t in found if t is not None})


async def plan_sweep(box: Mailbox, url: str, keep_rounds: int, orphans: bool) -> SweepPlan:
    """What to delete (reads only)."""
    manifest = await require_manifest(box, url)
    fragments = manifest.num_fragments
    # Commits whose parameters are not stored (dense_every=K) are computed from the newest
    # stored one and the rounds since: those rounds stay, as the closers keep them.
    keep_rounds = kept_rounds(keep_rounds, dense_every(manifest.algorithm))
    round_keys, snapshot_keys, claim_keys, beat_keys, blob_keys, resume_keys = await asyncio.gather(
        box.list(p.ROUNDS),
        box.list(p.SNAPSHOTS),
        box.list(p.CLAIMS),
        box.list(p.LEASES),
        box.list(p.BLOBS),
        box.list(p.RESUME),
    )
    newest = newest_per_fragment(round_keys, fragments)
    groups = await _group_keys(box) if is_moshpit(manifest) else None

    def old(r: int) -> bool:
        return is_old(r, newest, fragments, keep_rounds)

    snapshots: dict[str, bool] = {}  # key -> doomed
    for key in snapshot_keys:
        try:
            r, _ = p.parse_snapshot_key(key)
        except ProtocolError:
            continue  # not ours: leave it
        snapshots[key] = old(r)
    claim_rounds = {k: p.claim_round(k) for k in claim_keys}
    claims = [k for k, cr in claim_rounds.items() if cr is not None and old(cr)]
    group_read = [] if groups is None else [*groups.records, *groups.snapshots]
    records = await _read(box, [*round_keys, *snapshots, *resume_keys, *group_read])
    # The frozen parameters travel once, with the manifest: never old.
    kept: set[str] = {manifest.frozen_payload} if manifest.frozen_payload else set()
    # A learner's resume saves are its own to sweep (Session keeps the newest); their
    # payloads are named by no round or snapshot, so --orphans must not take them.
    for key in resume_keys:
        data = records[key]
        if data is None:
            continue
        try:
            kept.add(p.decode_resume(key, data).payload)
        except ProtocolError:
            continue  # unreadable: a restart of that learner starts fresh anyway
    candidates: set[str] = set()
    for key in round_keys:
        data = records[key]
        if data is None:
            continue
        commit = p.decode_commit(key, data)
        (candidates if old(commit.round) else kept).update(named_payloads(commit))
    for key, doomed in snapshots.items():
        data = records[key]
        if data is None:
            continue
        payload = p.decode_snapshot(key, data).payload
        (candidates if doomed else kept).add(payload)
    if groups is not None:
        # Group records and snapshots are read as the learners' sweep reads them: one that
        # does not decode names nothing (it is deleted with its round, or left).
        for key in group_read:
            data = records[key]
            if data is None:
                continue
            try:
                if key.startswith(p.GROUP_ROUNDS):
                    commit = p.decode_commit(key, data)
                    named = {commit.params, *(c.payload for c in commit.contributors)}
                else:
                    named = {p.decode_snapshot(key, data).payload}
            except ProtocolError:
                continue
            (candidates if groups.doomed(key, keep_rounds) else kept).update(named)
    # Payloads stored in parts occupy their parts too; a part named by a kept payload stays.
    kept = await payload_blobs(box, kept)
    candidates = await payload_blobs(box, candidates)
    existing = set(blob_keys)
    payloads = (candidates - kept) & existing
    if orphans:
        payloads |= existing - kept
    by_learner: dict[str, list[int]] = {}
    for key in beat_keys:
        try:
            learner, beat = p.parse_beat_key(key)
        except ProtocolError:
            continue
        if beat != p.LEAVING_BEAT:
            by_learner.setdefault(learner, []).append(beat)
    beats = [
        p.beat_key(learner, beat)
        for learner, numbers in by_learner.items()
        for beat in sorted(numbers)[:-2]
    ]
    plan = SweepPlan(
        keep_rounds,
        newest,
        snapshots=sorted(k for k, doomed in snapshots.items() if doomed),
        claims=sorted(claims),
        payloads=sorted(payloads),
        beats=sorted(beats),
    )
    if groups is None:
        return plan
    return replace(
        plan,
        newest_group_round=groups.newest,
        group_records=[k for k in groups.records if groups.doomed(k, keep_rounds)],
        group_snapshots=[k for k in groups.snapshots if groups.doomed(k, keep_rounds)],
        group_claims=[k for k in groups.claims if groups.doomed(k, keep_rounds)],
    )


@dataclass(frozen=True)
class _GroupKeys:
    """A Moshpit run's group keys, as listed (each a key of its kind; others left out)."""

    records: list[str]
    snapshots: list[str]
    claims: list[str]
    newest: int | None  # the newest group round with a commit

    def doomed(self, key: str, keep_rounds: int) -> bool:
        """Whether ``key`` is of a group round older than the newest ``keep_rounds`` with
        commits (rounds newer than the newest commit, under way, are never doomed)."""
        t = p.group_round_of(key)
        if t is None or self.newest is None:
            return False
        return t <= group_horizon(self.newest, keep_rounds)


async def _group_keys(box: Mailbox) -> _GroupKeys:
    record_keys, snapshot_keys, claim_keys = await asyncio.gather(
        box.list(p.GROUP_ROUNDS), box.list(p.GROUP_SNAPSHOTS), box.list(p.GROUP_CLAIMS)
    )
    records = [k for k in record_keys if _parses(p.parse_group_round_key, k)]
    snapshots = [k for k in snapshot_keys if _parses(p.parse_group_snapshot_key, k)]
    claims = [k for k in claim_keys if _is_group_claim(k)]
    rounds = [p.parse_group_round_key(k)[0] for k in records]
    return _GroupKeys(records, snapshots, claims, max(rounds, default=None))


def _parses(parse: Callable[[str], object], key: str) -> bool:
    try:
        parse(key)
    except ProtocolError:
        return False
    return True


def _is_group_claim(key: str) -> bool:
    """``group-claims/{t}/{group}/{attempt}``, exactly."""
    parts = key.split("/")
    t = p.group_round_of(key)
    if t is None or len(parts) != 4 or not key.startswith(p.GROUP_CLAIMS):
        return False
    try:
        return key == p.group_claim_key(t, parts[2], p.parse_claim_attempt(key))
    except (ProtocolError, ValueError):
        return False


def run_sweep(args: argparse.Namespace) -> int:
    if args.keep_rounds < 1:
        raise CliError("--keep-rounds must be >= 1", USAGE)
    url: str = args.url
    box = mailbox_for(url)
    console = out()
    try:
        plan = run_async(lambda: plan_sweep(box, url, args.keep_rounds, args.orphans))
        doomed = plan.keys()
        if not doomed:
            console.print(f"nothing to sweep at {url}", markup=False)
            return 0
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column()
        table.add_column(justify="right")
        for what, keys in (
            ("snapshots", plan.snapshots),
            ("closer claims", plan.claims),
            ("payloads (blobs/)" + (", orphans included" if args.orphans else ""), plan.payloads),
            ("old beats", plan.beats),
        ):
            table.add_row(f"  {what}", str(len(keys)))
        if plan.newest_group_round is not None:
            for what, keys in (
                ("group commits", plan.group_records),
                ("group snapshots", plan.group_snapshots),
                ("group closer claims", plan.group_claims),
            ):
                table.add_row(f"  {what}", str(len(keys)))
        table.add_row("  [bold]total[/]", f"[bold]{len(doomed)}[/]")
        newest = ", ".join(f"{f}: {r}" for f, r in sorted(plan.newest.items()))
        console.print(
            f"sweep of {url}: keeping the inputs of the newest {plan.keep_rounds} commits of "
            f"each fragment (newest rounds {newest}) and every round record",
            markup=False,
        )
        if plan.newest_group_round is not None:
            swept = plan.swept_group_rounds
            console.print(
                f"  and the newest {plan.keep_rounds} group rounds (newest group round "
                f"{plan.newest_group_round}); group rounds {_span(swept)} go whole",
                markup=False,
            )
        console.print(table)
        if not confirm(f"Delete these {len(doomed)} objects?", args.yes):
            err().print("nothing deleted")
            return 1
        run_async(lambda: _delete(box, doomed))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    console.print(f"deleted {len(doomed)} objects", markup=False)
    return 0


def _span(rounds: Sequence[int]) -> str:
    if not rounds:
        return "none"
    return str(rounds[0]) if rounds[0] == rounds[-1] else f"{rounds[0]}–{rounds[-1]}"


# -- rm ------------------------------------------------------------------------------------


def run_rm(args: argparse.Namespace) -> int:
    url: str = args.url
    box = mailbox_for(url)
    console = out()
    try:
        keys = list(run_async(lambda: box.list("")))
        if not keys:
            console.print(f"nothing to delete: {url} is empty", markup=False)
            return 0
        is_run = p.MANIFEST in keys or p.CREATOR in keys
        whole_bucket = isinstance(box, S3Mailbox) and not box.prefix
        warnings = []
        if not is_run:
            warnings.append(f"{url} holds no GradientMail run ({keys[0]}, …)")
        if whole_bucket:
            warnings.append(f"{url} names a whole bucket, not a prefix")
        for warning in warnings:
            err().print(f"[yellow]warning[/]: {warning}", highlight=False)
        if warnings and args.yes and not args.force:
            raise CliError("refusing with --yes alone: add --force (or answer the question)")
        question = f"Delete all {len(keys)} objects under {url}? This cannot be undone."
        if not confirm(question, args.yes):
            err().print("nothing deleted")
            return 1
        run_async(lambda: _delete(box, keys))
        left = run_async(lambda: box.list(""))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    if left:
        raise CliError(f"{len(left)} objects appeared while deleting (is a node still running?)")
    console.print(f"deleted {len(keys)} objects; {url} is empty", markup=False)
    return 0
