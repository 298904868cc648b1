"""``gradientmail align`` and ``gradientmail verify``: the model in a mailbox, without its
class. Both need torch and only read.

``align`` writes the newest commit of every fragment into one safetensors file, laid out
by the manifest (tensor names are the model's ``state_dict`` names): the fragments'
tensors, the frozen parameters, and each tied name the manifest records (``aliases``) as a
copy of its tensor (safetensors stores no shared tensors), so that
``model.load_state_dict(load_file(FILE), strict=True)`` takes it; the metadata holds the
rounds loaded and ``format: pt`` (which ``transformers``' ``from_pretrained`` requires).
Integer buffers (BatchNorm's ``num_batches_tracked``) never travel and are not in it.
``verify`` recomputes every commit whose inputs are still stored (its
contributions, its base commit) from its round record, and reports mismatches, and which
commits the sweep has made unverifiable.

A Moshpit run (``algorithms/moshpit.py``) has no run-wide commit after its initial one:
``align`` writes the sample-weighted average of the newest group round's commits, or the
parameters they all share when every group of that round committed the same (a full grid
has averaged everyone: the exact global average), and says which
(:func:`gradientmail.engine.align.describe_alignment`; the same read as ``gm.align``,
:func:`gradientmail.engine.align.read_aligned`); ``verify`` recomputes every group
commit whose members' payloads are still stored
(:func:`gradientmail.engine.verify.verify_group`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradientmail import wire as p
from gradientmail.cli._common import (
    USAGE,
    CliError,
    batches,
    err,
    mailbox_for,
    out,
    progress,
    readable_url,
    require_manifest,
    store_error,
)
from gradientmail.errors import (
    MailboxError,
    ObjectMissing,
    PayloadCorrupt,
    ProtocolError,
    RoundMissing,
)
from gradientmail.inspect import is_moshpit
from gradientmail.mailbox import Mailbox

if TYPE_CHECKING:
    from gradientmail.engine.align import Aligned

__all__ = ["add_parsers", "run_align", "run_verify"]

_BATCH = 64

# What stays verifiable after sweeping: see coord/sweep.py and engine/verify.py.
SWEPT_HINT = (
    "A commit can be verified while its own inputs (the snapshots it combined, its "
    "parameters and momentum) and its base's (the previous commit of its fragment) are "
    "stored. A sweep (the nodes' own, or gradientmail sweep) keeps those of each "
    "fragment's newest keep_rounds commits (2 unless the run set it), so after it only "
    "each fragment's newest keep_rounds - 1 commits stay verifiable (with 2: the newest), "
    "and its initial commit while it is among those kept. To verify every commit, run "
    "verify while the run goes, or give the run a larger keep_rounds."
)
# The same for a Moshpit run's group commits: see engine/groups.py (GroupRounds.sweep).
GROUP_SWEPT_HINT = (
    "A group commit can be verified while its members' payloads and its parameters are "
    "stored. The learners' own sweep keeps the newest keep_rounds + 1 group rounds (3 "
    "unless the run set keep_rounds), gradientmail sweep the newest --keep-rounds, and "
    "deletes older group rounds whole. To verify every group commit, run verify while the "
    "run goes, or give the run a larger keep_rounds."
)


_ALIGN_ABOUT = (
    "Write the newest commit of every fragment into one safetensors file (tensor names are "
    "the model's state_dict names, tied names included, as in the run's manifest), for "
    "evaluation or from_pretrained; no model class needed. For a Moshpit run: the "
    "sample-weighted average of the newest group round's commits, or the parameters they "
    "all share once the grid has averaged everyone; it says which."
)
_VERIFY_ABOUT = (
    "Recompute every commit whose inputs are still in the mailbox from its round record "
    "(contributions, base commit, outer momentum) and compare; report mismatches (exit 1) "
    "and the commits the sweep has made unverifiable. A Moshpit run's group commits are "
    "recomputed from their members' payloads. " + SWEPT_HINT
)


def add_parsers(sub: Any) -> None:
    what = "write the newest committed parameters into one safetensors file"
    align = sub.add_parser("align", help=what, description=_ALIGN_ABOUT)
    align.add_argument("url", help="the run's mailbox URL")
    align.add_argument("--out", "-o", type=Path, required=True, help="file to write")
    what = "recompute every commit still verifiable; exit 1 on a mismatch"
    verify = sub.add_parser("verify", help=what, description=_VERIFY_ABOUT)
    verify.add_argument("url", help="the run's mailbox URL")
    verify.add_argument("-v", "--verbose", action="store_true", help="one line per commit")


def _import_torch() -> None:
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        raise CliError(
            f"this command needs {exc.name}: install the [torch] extra from your GradientMail "
            "checkout (pip install '/path/to/checkout[torch]')"
        ) from None


async def _records(
    box: Mailbox, keys: Sequence[str], advance: Any = None
) -> dict[str, bytes | None]:
    found: dict[str, bytes | None] = {}
    for batch in batches(keys, _BATCH):
        values = await asyncio.gather(*(box.get(key) for key in batch))
        found.update(zip(batch, values, strict=True))
        if advance is not None:
            advance(len(batch))
    return found


# -- align ---------------------------------------------------------------------------------


def _checked(url: str) -> tuple[Mailbox, p.Manifest]:
    """Open ``url`` and read its manifest (failing fast, before torch is imported), then
    make sure torch is there."""
    box = mailbox_for(url)
    try:
        manifest = asyncio.run(require_manifest(box, url))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    _import_torch()
    return box, manifest


async def _align(box: Mailbox, url: str, manifest: p.Manifest) -> tuple[Aligned, dict[str, Any]]:
    """The run's aligned model (:func:`gradientmail.engine.align.read_aligned`, what
    ``gm.align`` loads) laid out by the manifest alone, and its fragments' tensors by name."""
    from gradientmail.engine.align import read_aligned
    from gradientmail.engine.layout import ModelLayout

    layout = ModelLayout.from_manifest(manifest)
    try:
        with progress("downloading the aligned model", 1) as advance:
            loaded = await read_aligned(box, manifest, layout)
            advance(1)
    except RoundMissing as exc:
        raise CliError(f"the run at {url} has no model yet: {exc}") from exc
    return loaded, file_tensors(layout)


def file_tensors(layout: Any) -> dict[str, Any]:
    """Every tensor of ``layout`` (a :class:`~gradientmail.engine.layout.ModelLayout`) by
    ``state_dict`` name: the fragments', the frozen parameters, and each alias (a tied
    name) as a copy of its tensor: safetensors refuses two names sharing one storage."""
    tensors: dict[str, Any] = {}
    for fragment in range(layout.count):
        tensors.update(layout.copy_out(fragment))
    tensors.update(layout.frozen_tensors())
    for alias, name in sorted(layout.aliases.items()):
        tensors[alias] = tensors[name].clone()
    return tensors


def _why(exc: BaseException) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _writable(target: Path) -> None:
    """Fail before any download when ``--out`` cannot be written: a directory, a parent
    that is a file or cannot be created, a folder without write permission."""
    if target.is_dir():
        raise CliError(f"--out {target}: is a directory", USAGE)
    folder = target.parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CliError(f"--out {target}: {existing} is a file, not a folder", USAGE)
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"--out {target}: {existing} is not writable")


def run_align(args: argparse.Namespace) -> int:
    url: str = args.url
    target: Path = args.out
    _writable(target)
    box, manifest = _checked(url)
    from safetensors.torch import save_file

    try:
        loaded, tensors = asyncio.run(_align(box, url, manifest))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    rounds = loaded.rounds
    metadata = {
        "format": "pt",  # transformers' from_pretrained refuses a file without it
        "gradientmail.rounds": json.dumps({str(f): r for f, r in sorted(rounds.items())}),
        "gradientmail.mailbox": url,
    }
    if loaded.description is not None:
        metadata["gradientmail.aligned"] = loaded.description
        metadata["gradientmail.groups"] = json.dumps(list(loaded.groups))
    partial = target.with_name(f".{target.name}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, target)
    except Exception as exc:  # OSError, or safetensors' own error for the same causes
        partial.unlink(missing_ok=True)
        raise CliError(f"--out {target}: cannot write it: {_why(exc)}") from None
    tied = {a: n for a, n in manifest.aliases.items() if a in tensors}
    count = sum(t.numel() for name, t in tensors.items() if name not in tied)
    if loaded.description is not None:
        loaded_what = loaded.description
    else:
        newest = ", ".join(f"{f}: {r}" for f, r in sorted(rounds.items()))
        loaded_what = f"newest rounds {newest} (fragment: round)"
    ties = f" ({len(tied)} tied: {_tied_words(tied)})" if tied else ""
    out().print(
        f"wrote {target}: {len(tensors)} tensors{ties}, {count:,} parameters, {loaded_what}",
        markup=False,
    )
    return 0


def _tied_words(tied: dict[str, str], most: int = 3) -> str:
    words = [f"{a} = {n}" for a, n in sorted(tied.items())[:most]]
    return ", ".join(words) + (f", {len(tied) - most} more" if len(tied) > most else "")


# -- verify --------------------------------------------------------------------------------


def _ranges(numbers: Sequence[int]) -> str:
    parts: list[str] = []
    ordered = sorted(numbers)
    start = prev = ordered[0] if ordered else 0
    for n in [*ordered[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(parts) if ordered else ""


@dataclass
class _Tally:
    """What verify found of one kind of commit (run-wide rounds, or group commits)."""

    keys: list[str]  # every commit listed
    verified: int = 0
    unverifiable: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


class _Commits:
    """Run-wide round commits: each recomputed from its contributions and its base (the
    previous commit of its fragment), while they are stored (``engine/verify.py``)."""

    title = "verifying commits"

    def __init__(self, box: Mailbox, manifest: p.Manifest, blobs: set[str]) -> None:
        self.box, self.manifest, self.blobs = box, manifest, blobs

    @staticmethod
    async def keys(box: Mailbox) -> list[str]:
        return list(await box.list(p.ROUNDS))

    @staticmethod
    def label(key: str) -> str:
        return f"round {p.parse_round_key(key)}"

    async def inputs(
        self, key: str, commit: p.Commit, records: dict[str, bytes | None]
    ) -> tuple[set[str], bool] | None:
        """The payloads ``commit`` needs stored, and whether it is computed along a chain
        of older rounds (an unstored base); None when its base is gone or unreadable."""
        r, fragments = commit.round, self.manifest.num_fragments
        # Unstored parameters (dense_every) are not in the listing: their hash is checked.
        needed = {c.payload for c in commit.contributors}
        if commit.stored:
            needed.add(commit.params)
        if r < fragments:
            return needed, False
        base_key = p.round_key(r - fragments)
        base_data = records.get(base_key) or await self.box.get(base_key)
        try:
            base = p.decode_commit(base_key, base_data)
        except ProtocolError:
            return None  # gone, or reported as that round's own mismatch
        needed |= {base.params} if base.stored else set()
        needed |= {base.momentum} if base.momentum else set()
        return needed, not base.stored

    async def check(self, key: str) -> str:
        from gradientmail.engine.verify import verify_commit

        result = await verify_commit(self.box, p.parse_round_key(key), self.manifest)
        who = "+".join(result.contributors) or "(initial)"
        return f"round {result.round:6d}  fragment {result.fragment}  {who}  OK"


class _GroupCommits(_Commits):
    """A Moshpit run's group commits: each recomputed from its members' payloads while they
    and its parameters are stored (``engine/verify.py``'s ``verify_group``)."""

    title = "verifying group commits"

    @staticmethod
    async def keys(box: Mailbox) -> list[str]:
        found = []
        for key in await box.list(p.GROUP_ROUNDS):
            try:
                p.parse_group_round_key(key)
            except ProtocolError:
                continue  # not a group commit (someone else's object)
            found.append(key)
        return found

    @staticmethod
    def label(key: str) -> str:
        t, group = p.parse_group_round_key(key)
        return f"group round {t} group {group}"

    async def inputs(
        self, key: str, commit: p.Commit, records: dict[str, bytes | None]
    ) -> tuple[set[str], bool] | None:
        return {c.payload for c in commit.contributors} | {commit.params}, False

    async def check(self, key: str) -> str:
        from gradientmail.engine.verify import verify_group

        result = await verify_group(self.box, key, self.manifest)
        t, group = p.parse_group_round_key(key)
        return f"group round {t:6d}  group {group}  {'+'.join(result.contributors)}  OK"


async def _verify(
    box: Mailbox, manifest: p.Manifest, kind: type[_Commits], verbose: bool
) -> _Tally:
    """Recompute every commit of ``kind`` whose inputs are still stored."""
    tally = _Tally(await kind.keys(box))
    commits = kind(box, manifest, set(await box.list(p.BLOBS)))
    console = out()
    with progress(kind.title, len(tally.keys) * 2) as advance:
        records = await _records(box, tally.keys, advance)
        for key in tally.keys:
            await _verify_one(commits, key, records, tally, console if verbose else None)
            advance(1)
    return tally


async def _verify_one(
    commits: _Commits,
    key: str,
    records: dict[str, bytes | None],
    tally: _Tally,
    console: Any,
) -> None:
    try:
        commit = p.decode_commit(key, records[key])
    except ProtocolError as exc:
        if records[key] is None:  # deleted since the listing
            tally.unverifiable.append(key)
        else:
            tally.mismatches.append(f"{commits.label(key)}: {exc}")
        return
    inputs = await commits.inputs(key, commit, records)
    if inputs is None or not inputs[0] <= commits.blobs:
        tally.unverifiable.append(key)
        return
    needed, chained = inputs
    try:
        line = await commits.check(key)
    except (ProtocolError, PayloadCorrupt) as exc:
        still = await asyncio.gather(*(commits.box.list(k) for k in sorted(needed)))
        # An unstored base is computed along its chain, whose older rounds the sweep may
        # have taken: an object missing there is not a mismatch.
        if all(still) and not (chained and isinstance(exc, ObjectMissing)):
            tally.mismatches.append(f"{commits.label(key)}: {exc}")
        else:  # swept while this ran
            tally.unverifiable.append(key)
        return
    tally.verified += 1
    if console is not None:
        console.print(line, markup=False)


def _summary(console: Any, what: str, tally: _Tally) -> None:
    total = len(tally.keys)
    console.print(
        f"{total} {what}: {tally.verified} verified, {len(tally.unverifiable)} no longer "
        f"verifiable, {len(tally.mismatches)} mismatched",
        markup=False,
    )


def _checkable(url: str, manifest: p.Manifest, tally: _Tally) -> str:
    """What the sweep left checkable of a run-wide round exchange, and how to keep more:
    each fragment's commits count, and a run of this length keeps every commit verifiable
    with keep_rounds at least its longest fragment's count (``coord/sweep.py``)."""
    fragments = manifest.num_fragments
    per_fragment: dict[int, int] = {}
    for key in tally.keys:
        f = p.parse_round_key(key) % fragments
        per_fragment[f] = per_fragment.get(f, 0) + 1
    needed = max(per_fragment.values(), default=1)
    shown = shlex.quote(readable_url(url))
    return (
        f"checkable: {tally.verified} of {len(tally.keys)} commits, those whose inputs the "
        f"sweep kept. To check all {len(tally.keys)}: run `gradientmail verify {shown}` while "
        "the run goes (with the default keep_rounds 2 a commit stays checkable until its "
        f"fragment's next commit lands), or give a run this long keep_rounds >= {needed} "
        f"(Session(keep_rounds={needed}))."
    )


def run_verify(args: argparse.Namespace) -> int:
    url: str = args.url
    box, manifest = _checked(url)
    moshpit = is_moshpit(manifest)
    try:
        rounds = asyncio.run(_verify(box, manifest, _Commits, args.verbose))
        groups = (
            asyncio.run(_verify(box, manifest, _GroupCommits, args.verbose)) if moshpit else None
        )
    except MailboxError as exc:
        raise store_error(url, exc) from None
    console = out()
    _summary(console, "commits", rounds)
    if rounds.unverifiable:
        swept = [p.parse_round_key(k) for k in rounds.unverifiable]
        console.print(
            f"  not verifiable (their inputs were swept): rounds {_ranges(swept)}", markup=False
        )
        console.print(f"  {_checkable(url, manifest, rounds)}", markup=False)
        console.print(f"  {SWEPT_HINT}", markup=False)
    mismatches = list(rounds.mismatches)
    if groups is not None:
        _summary(console, "group commits", groups)
        if groups.unverifiable:
            swept = sorted({p.parse_group_round_key(k)[0] for k in groups.unverifiable})
            console.print(
                f"  not verifiable (their members' payloads were swept): group rounds "
                f"{_ranges(swept)}",
                markup=False,
            )
            console.print(f"  {GROUP_SWEPT_HINT}", markup=False)
        mismatches += groups.mismatches
    if mismatches:
        errors = err()
        for line in mismatches:
            errors.print(f"  MISMATCH {line}", markup=False)
        return 1
    return 0
