"""``gradientmail align`` and ``gradientmail verify``: the model in a mailbox, without its
class. Both need torch and only read.

``align`` writes the newest commit of every fragment into one safetensors file, laid out
by the manifest (tensor names are the model's parameter names), with the rounds loaded in
its metadata. ``verify`` recomputes every commit whose inputs are still stored (its
contributions, its base commit) from its round record, and reports mismatches, and which
commits the sweep has made unverifiable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
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


def add_parsers(sub: Any) -> None:
    align = sub.add_parser(
        "align",
        help="write the newest committed parameters into one safetensors file",
        description="Write the newest commit of every fragment into one safetensors file "
        "(tensor names are the model's parameter names, as in the run's manifest), for "
        "evaluation; no model class needed.",
    )
    align.add_argument("url", help="the run's mailbox URL")
    align.add_argument("--out", "-o", type=Path, required=True, help="file to write")
    verify = sub.add_parser(
        "verify",
        help="recompute every commit still verifiable; exit 1 on a mismatch",
        description="Recompute every commit whose inputs are still in the mailbox from its "
        "round record (contributions, base commit, outer momentum) and compare; report "
        "mismatches (exit 1) and the commits the sweep has made unverifiable. " + SWEPT_HINT,
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


async def _align(
    box: Mailbox, url: str, manifest: p.Manifest
) -> tuple[dict[str, Any], dict[int, int]]:
    from gradientmail.algorithms.base import from_manifest
    from gradientmail.engine.chain import commit_tensors

    algorithm = from_manifest(manifest.algorithm)
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
        return tensors, newest
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
        tensors, rounds = asyncio.run(_align(box, url, manifest))
    except MailboxError as exc:
        raise store_error(url, exc) from None
    metadata = {
        "gradientmail.rounds": json.dumps({str(f): r for f, r in sorted(rounds.items())}),
        "gradientmail.mailbox": url,
    }
    partial = target.with_name(f".{target.name}.partial")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, target)
    except Exception as exc:  # OSError, or safetensors' own error for the same causes
        partial.unlink(missing_ok=True)
        raise CliError(f"--out {target}: cannot write it: {_why(exc)}") from None
    count = sum(t.numel() for t in tensors.values())
    out().print(
        f"wrote {target}: {len(tensors)} tensors, {count:,} parameters, "
        f"newest rounds {', '.join(f'{f}: {r}' for f, r in sorted(rounds.items()))} "
        "(fragment: round)",
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


def run_verify(args: argparse.Namespace) -> int:
    url: str = args.url
    box, manifest = _checked(url)
    try:
        verified, unverifiable, mismatches = asyncio.run(_verify(box, manifest, args.verbose))
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
    if mismatches:
        errors = err()
        for line in mismatches:
            errors.print(f"  MISMATCH {line}", markup=False)
        return 1
    return 0
