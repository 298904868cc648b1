"""Joining a run: creator election, the manifest, initial commits, loading newest commits.

Shared by :class:`Session` (which joins) and :func:`align` (which only loads).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from functools import partial

import torch

from gradientmail import protocol as p
from gradientmail._layout import ModelLayout
from gradientmail._retry import retrying
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.errors import ProtocolError
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors

__all__ = ["align", "establish", "load_newest", "newest_per_fragment"]

_POLL = 0.2


async def _wait_for(box: Mailbox, key: str, deadline: float, what: str) -> bytes:
    while True:
        data = await retrying(lambda: box.get(key), deadline=deadline)
        if data is not None:
            return data
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {key} did not appear in time")
        await asyncio.sleep(_POLL)


async def establish(
    box: Mailbox, layout: ModelLayout, algorithm: DiLoCo, learner: str, timeout: float
) -> tuple[p.Manifest, bool]:
    """Create the run (if this node wins the creator claim) or join the existing one.

    Returns the manifest and whether this node is the creator. Raises ``ProtocolError`` if
    the run's model or algorithm differ from this node's.
    """
    deadline = time.monotonic() + timeout
    mine = layout.manifest(learner, algorithm)
    existing = await retrying(lambda: box.get(p.MANIFEST), deadline=deadline)
    creator = False
    if existing is None:
        claim = p.encode(p.CreatorClaim(learner))
        won = await retrying(lambda: box.put_if_absent(p.CREATOR, claim), deadline=deadline)
        data = await retrying(lambda: box.get(p.CREATOR), deadline=deadline)
        if data is None:
            raise ProtocolError(
                f"{p.CREATOR}: put_if_absent reported it exists but it reads as missing; the "
                "store is not read-after-write consistent"
            )
        holder = p.decode_creator(p.CREATOR, data).learner
        creator = won or holder == learner  # a restarted creator finds its own claim
        if creator:
            # Payloads before the records that point at them; every write is idempotent,
            # so a creator that crashed half-way and restarts completes the same objects.
            await retrying(lambda: box.put_if_absent(p.MANIFEST, p.encode(mine)), deadline=deadline)
            for fragment in range(layout.count):
                tensors = layout.copy_out(fragment)
                key, _ = await retrying(partial(put_tensors, box, tensors), deadline=deadline)
                commit = p.Commit(fragment, fragment, None, (), key, None, learner)
                record = p.encode(commit)
                await retrying(
                    partial(box.put_if_absent, p.round_key(fragment), record), deadline=deadline
                )
        existing = await _wait_for(box, p.MANIFEST, deadline, f"waiting for creator {holder}")
    manifest = p.decode_manifest(p.MANIFEST, existing)
    differences = manifest.differences(mine)
    if differences:
        raise ProtocolError(
            f"this node does not match the run (created by {manifest.creator}): "
            + "; ".join(differences)
        )
    for fragment in range(manifest.num_fragments):
        await _wait_for(box, p.round_key(fragment), deadline, "waiting for the initial commits")
    return manifest, creator


def newest_per_fragment(keys: Sequence[str], fragments: int) -> dict[int, int]:
    newest: dict[int, int] = {}
    for key in keys:
        r = p.parse_round_key(key)
        newest[r % fragments] = max(r, newest.get(r % fragments, -1))
    return newest


async def load_newest(
    box: Mailbox, layout: ModelLayout, deadline: float | None = None
) -> tuple[dict[int, int], dict[int, dict[str, torch.Tensor]]]:
    """Download the newest commit of every fragment; return rounds and verified tensors."""
    keys = await retrying(lambda: box.list(p.ROUNDS), deadline=deadline)
    newest = newest_per_fragment(keys, layout.count)
    missing = [f for f in range(layout.count) if f not in newest]
    if missing:
        raise ProtocolError(f"fragments {missing} have no commit yet; has the run been created?")
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    for fragment, r in newest.items():
        key = p.round_key(r)
        commit = p.decode_commit(key, await retrying(partial(box.get, key), deadline=deadline))
        tensors[fragment] = await retrying(
            partial(get_tensors, box, commit.params, layout.specs[fragment]), deadline=deadline
        )
    return newest, tensors


async def _align(model: torch.nn.Module, box: Mailbox, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    manifest_bytes = await _wait_for(box, p.MANIFEST, deadline, "align")
    manifest = p.decode_manifest(p.MANIFEST, manifest_bytes)
    algorithm = DiLoCo.from_settings(manifest.algorithm)
    layout = ModelLayout(model, algorithm)
    differences = manifest.differences(layout.manifest(manifest.creator, algorithm))
    if differences:
        raise ProtocolError("the model does not match the run: " + "; ".join(differences))
    rounds, tensors = await load_newest(box, layout, deadline)
    for fragment, values in tensors.items():
        layout.load(fragment, values)
    return rounds


def align(model: torch.nn.Module, *, mailbox: Mailbox, timeout: float = 60.0) -> dict[int, int]:
    """Load the run's newest committed parameters into ``model`` without joining.

    Returns ``{fragment: round}`` of the commits loaded. For evaluation, or to start a new
    process from the run's current state.
    """
    from gradientmail._threads import run_coroutine

    return run_coroutine(_align(model, mailbox, timeout))
