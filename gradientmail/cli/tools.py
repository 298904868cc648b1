"""``gradientmail align`` and ``gradientmail verify``: the model in a mailbox, without its
class. Both need torch and only read.

``align`` writes the newest commit of every fragment into one safetensors file, laid out
by the manifest (tensor names are the model's parameter names), with the rounds loaded in
its metadata. ``verify`` recomputes every commit whose inputs are still stored (its
contributions, its base commit) from its round record, and reports mismatches, and which
commits the sweep has made unverifiable.

A Moshpit run (``algorithms/moshpit.py``) has no run-wide commit after its initial one:
``align`` writes the sample-weighted average of the newest group round's commits, or the
parameters they all share when every group of that round committed the same (a full grid
has averaged everyone: the exact global average), and says which
(:func:`gradientmail.engine.groups.describe_alignment`); ``verify`` recomputes every group
commit whose members' payloads are still stored
(:func:`gradientmail.engine.verify.verify_group`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradientmail import wire as p
from gradientmail.cli._common import (
    USAGE,
    CliError,
    batches,
    err,
    mailbox_for,
    out,
    progress,
    require_manifest,
    store_error,
)
from gradientmail.errors import MailboxError, PayloadCorrupt, ProtocolError
from gradientmail.mailbox import Mailbox

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


def add_parsers(sub: Any) -> None:
    align = sub.add_parser(
        "align",
        help="write the newest committed parameters into one safetensors file",
        description="Write the newest commit of every fragment into one safetensors file "
        "(tensor names are the model's parameter names, as in the run's manifest), for "
        "evaluation; no model class needed. For a Moshpit run: the sample-weighted average "
        "of the newest group round's commits, or the parameters they all share once the "
        "grid has averaged everyone; it says which.",
    )
    align.add_argument("url", help="the run's mailbox URL")
    align.add_argument("--out", "-o", type=Path, required=True, help="file to write")
    verify = sub.add_parser(
        "verify",
        help="recompute every commit still verifiable; exit 1 on a mismatch",
        description="Recompute every commit whose inputs are still in the mailbox from its "
        "round record (contributions, base commit, outer momentum) and compare; report "
        "mismatches (exit 1) and the commits the sweep has made unverifiable. A Moshpit "
        "run's group commits are recomputed from their members' payloads. " + SWEPT_HINT,
    )
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


def _newest(keys: Sequence[str], fragments: int) -> dict[int, int]:
    newest: dict[int, int] = {}
    for key in keys:
        r = p.parse_round_key(key)
        newest[r % fragments] = max(r, newest.get(r % fragments, -1))
    return newest


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


@dataclass
class _Aligned:
    """What align loaded: the tensors, ``{fragment: round}`` (a Moshpit run's: ``{0: group
    round}``) and, for a Moshpit run, which group commits, in words and by group."""

    tensors: dict[str, Any]
    rounds: dict[int, int]
    description: str | None = None
    groups: tuple[str, ...] = ()


async def _align(box: Mailbox, url: str, manifest: p.Manifest) -> _Aligned:
    from gradientmail.algorithms.base import from_manifest
    from gradientmail.engine.chain import commit_tensors

    algorithm = from_manifest(manifest.algorithm)
    if _is_moshpit(manifest):
        groups = await _align_groups(box, manifest)
        if groups is not None:
            return groups
    for attempt in range(3):
        newest = _newest(await box.list(p.ROUNDS), manifest.num_fragments)
        missing = [f for f in range(manifest.num_fragments) if f not in newest]
        if missing:
            raise CliError(f"fragments {missing} of the run at {url} have no commit yet")
        tensors: dict[str, Any] = {}
        try:
            with progress("downloading fragments", len(newest)) as advance:
                for fragment, r in sorted(newest.items()):
                    key = p.round_key(r)
                    commit = p.decode_commit(key, await box.get(key))
                    specs = manifest.fragments[fragment]
                    tensors.update(await commit_tensors(box, algorithm, specs, commit))
                    advance(1)
        except ProtocolError as exc:
            if "missing" in str(exc) and attempt < 2:
                continue  # swept under us by a live run: list again
            raise
        description = None
        if _is_moshpit(manifest):  # before its first group round: the initial commit
            from gradientmail.engine.groups import describe_alignment

            description = describe_alignment([])
        return _Aligned(tensors, newest, description)
    raise AssertionError("unreachable")


def _is_moshpit(manifest: p.Manifest) -> bool:
    return manifest.algorithm.get("name") == "moshpit"


def _manifest_model(manifest: p.Manifest) -> Any:
    """A module holding zeros shaped as the manifest's tensors, under their names (nested
    modules for the dots): what ``ModelLayout.for_run`` needs to lay a run out without the
    model's class."""
    import torch

    root = torch.nn.Module()
    for spec in (*(s for fragment in manifest.fragments for s in fragment), *manifest.frozen):
        *path, attr = spec.name.split(".")
        module = root
        for part in path:
            child = dict(module.named_children()).get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        value = torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype.removeprefix("torch.")))
        if spec.kind == p.BUFFER:
            module.register_buffer(attr, value)
        else:
            trainable = spec.kind != p.FROZEN
            module.register_parameter(attr, torch.nn.Parameter(value, requires_grad=trainable))
    return root


async def _align_groups(box: Mailbox, manifest: p.Manifest) -> _Aligned | None:
    """A Moshpit run's aligned parameters (:func:`gradientmail.engine.groups.aligned`:
    what ``gm.align`` loads), or None before the first group round (the initial commit is
    then the model)."""
    from gradientmail.algorithms.base import from_manifest
    from gradientmail.algorithms.moshpit import Moshpit
    from gradientmail.engine.groups import aligned, describe_alignment
    from gradientmail.engine.layout import ModelLayout

    algorithm = from_manifest(manifest.algorithm)
    if not isinstance(algorithm, Moshpit):  # pragma: no cover - the manifest said moshpit
        raise CliError(f"the run's algorithm {manifest.algorithm!r} is not Moshpit")
    layout = ModelLayout.for_run(_manifest_model(manifest), manifest)
    for attempt in range(3):
        try:
            with progress("downloading the newest group commits", 1) as advance:
                commits, params = await aligned(box, algorithm, layout)
                advance(1)
        except ProtocolError as exc:
            if "missing" in str(exc) and attempt < 2:
                continue  # swept under us by a live run: list again
            raise
        if params is None:
            return None
        return _Aligned(
            dict(params),
            {0: commits[0].round},
            describe_alignment(commits),
            tuple(sorted(c.group or "" for c in commits)),
        )
    raise AssertionError("unreachable")


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
        loaded = asyncio.run(_align(box, url, manifest))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    tensors, rounds = loaded.tensors, loaded.rounds
    metadata = {
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
    count = sum(t.numel() for t in tensors.values())
    if loaded.description is not None:
        loaded_what = loaded.description
    else:
        newest = ", ".join(f"{f}: {r}" for f, r in sorted(rounds.items()))
        loaded_what = f"newest rounds {newest} (fragment: round)"
    out().print(
        f"wrote {target}: {len(tensors)} tensors, {count:,} parameters, {loaded_what}",
        markup=False,
    )
    return 0


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


async def _verify(
    box: Mailbox, manifest: p.Manifest, verbose: bool
) -> tuple[int, list[int], list[str]]:
    from gradientmail.engine.verify import verify_commit

    fragments = manifest.num_fragments
    keys = list(await box.list(p.ROUNDS))
    blobs = set(await box.list(p.BLOBS))
    console = out()
    verified = 0
    unverifiable: list[int] = []
    mismatches: list[str] = []
    with progress("verifying commits", len(keys) * 2) as advance:
        records = await _records(box, keys, advance)
        for key in keys:
            r = p.parse_round_key(key)
            try:
                commit = p.decode_commit(key, records[key])
            except ProtocolError as exc:
                if records[key] is None:  # deleted since the listing
                    unverifiable.append(r)
                else:
                    mismatches.append(f"round {r}: {exc}")
                advance(1)
                continue
            # Unstored parameters (dense_every) are not in the listing: their hash is checked.
            needed = {c.payload for c in commit.contributors}
            if commit.stored:
                needed.add(commit.params)
            base = None
            if r >= fragments:
                base_key = p.round_key(r - fragments)
                base_data = records.get(base_key) or await box.get(base_key)
                if base_data is not None:
                    try:
                        base = p.decode_commit(base_key, base_data)
                    except ProtocolError:
                        base = None  # reported as that round's own mismatch
                    else:
                        needed |= {base.params} if base.stored else set()
                        needed |= {base.momentum} if base.momentum else set()
            if (r >= fragments and base is None) or not needed <= blobs:
                unverifiable.append(r)
                advance(1)
                continue
            try:
                result = await verify_commit(box, r, manifest)
            except (ProtocolError, PayloadCorrupt) as exc:
                still = await asyncio.gather(*(box.list(k) for k in sorted(needed)))
                # An unstored base is computed along its chain, whose older rounds the
                # sweep may have taken: a payload missing there is not a mismatch.
                chained = base is not None and not base.stored and "missing" in str(exc)
                if all(still) and not chained:
                    mismatches.append(f"round {r}: {exc}")
                else:  # swept while this ran
                    unverifiable.append(r)
            else:
                verified += 1
                if verbose:
                    who = "+".join(result.contributors) or "(initial)"
                    console.print(
                        f"round {r:6d}  fragment {result.fragment}  {who}  OK", markup=False
                    )
            advance(1)
    return verified, unverifiable, mismatches


async def _verify_groups(
    box: Mailbox, manifest: p.Manifest, verbose: bool
) -> tuple[int, list[str], list[str]]:
    """A Moshpit run's group commits: each recomputed from its members' payloads while they
    and its parameters are stored (``engine/verify.py``'s ``verify_group``). Returns the
    count verified, the keys no longer verifiable and the mismatches."""
    from gradientmail.engine.verify import verify_group

    keys = []
    for key in await box.list(p.GROUP_ROUNDS):
        try:
            p.parse_group_round_key(key)
        except ProtocolError:
            continue  # not a group commit (someone else's object)
        keys.append(key)
    blobs = set(await box.list(p.BLOBS))
    console = out()
    verified = 0
    unverifiable: list[str] = []
    mismatches: list[str] = []
    with progress("verifying group commits", len(keys) * 2) as advance:
        records = await _records(box, keys, advance)
        for key in keys:
            t, group = p.parse_group_round_key(key)
            try:
                commit = p.decode_commit(key, records[key])
            except ProtocolError as exc:
                if records[key] is None:  # deleted since the listing
                    unverifiable.append(key)
                else:
                    mismatches.append(f"group round {t} group {group}: {exc}")
                advance(1)
                continue
            needed = {c.payload for c in commit.contributors} | {commit.params}
            if not needed <= blobs:
                unverifiable.append(key)
                advance(1)
                continue
            try:
                result = await verify_group(box, key, manifest)
            except (ProtocolError, PayloadCorrupt) as exc:
                still = await asyncio.gather(*(box.list(k) for k in sorted(needed)))
                if all(still):
                    mismatches.append(f"group round {t} group {group}: {exc}")
                else:  # swept while this ran
                    unverifiable.append(key)
            else:
                verified += 1
                if verbose:
                    who = "+".join(result.contributors)
                    console.print(f"group round {t:6d}  group {group}  {who}  OK", markup=False)
            advance(1)
    return verified, unverifiable, mismatches


def run_verify(args: argparse.Namespace) -> int:
    url: str = args.url
    box, manifest = _checked(url)
    moshpit = _is_moshpit(manifest)
    groups: tuple[int, list[str], list[str]] = (0, [], [])
    try:
        verified, unverifiable, mismatches = asyncio.run(_verify(box, manifest, args.verbose))
        if moshpit:
            groups = asyncio.run(_verify_groups(box, manifest, args.verbose))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    total = verified + len(unverifiable) + len(mismatches)
    console = out()
    console.print(
        f"{total} commits: {verified} verified, {len(unverifiable)} no longer verifiable, "
        f"{len(mismatches)} mismatched",
        markup=False,
    )
    if unverifiable:
        console.print(
            f"  not verifiable (their inputs were swept): rounds {_ranges(unverifiable)}",
            markup=False,
        )
        console.print(f"  {SWEPT_HINT}", markup=False)
    group_verified, group_unverifiable, group_mismatches = groups
    if moshpit:
        group_total = group_verified + len(group_unverifiable) + len(group_mismatches)
        console.print(
            f"{group_total} group commits: {group_verified} verified, "
            f"{len(group_unverifiable)} no longer verifiable, {len(group_mismatches)} mismatched",
            markup=False,
        )
        if group_unverifiable:
            swept = sorted({p.parse_group_round_key(k)[0] for k in group_unverifiable})
            console.print(
                f"  not verifiable (their members' payloads were swept): group rounds "
                f"{_ranges(swept)}",
                markup=False,
            )
            console.print(f"  {GROUP_SWEPT_HINT}", markup=False)
    if mismatches or group_mismatches:
        errors = err()
        for line in [*mismatches, *group_mismatches]:
            errors.print(f"  MISMATCH {line}", markup=False)
        return 1
    return 0
