"""A commit's parameters, stored or not: the payload its record names, or, for a record
whose parameters were not stored (``Commit.stored`` false: ``SparseLoCo(dense_every=K)``),
computed from the newest stored commit before it and the contributions of the rounds in
between, as their closers computed them.

Each round of the chain is checked on the way: its parameters must hash to the key its
record names (the closer put that hash there), so a chain computes what was committed or
raises ``ProtocolError`` naming the round. Only stateless algorithms leave parameters
unstored, so nothing but the parameters is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import Algorithm
from gradientmail.coord.retry import retrying
from gradientmail.engine.sums import Member, Unusable, weighted_sums
from gradientmail.errors import ProtocolError
from gradientmail.ledger import DOWNLOAD
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, stored_key

__all__ = ["MAX_CHAIN", "commit_tensors", "step_from_contributions"]

MAX_CHAIN = 10_000  # rounds followed back to a stored commit, at most


async def step_from_contributions(
    box: Mailbox,
    algorithm: Algorithm,
    specs: Sequence[p.TensorSpec],
    commit: p.Commit,
    base: Mapping[str, torch.Tensor],
    own: tuple[str, Mapping[str, torch.Tensor]] | None = None,
    out: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``commit``'s parameters from its base's (``base``, float32) and its contributions
    (laid out as ``specs``, the model's dtypes), checked against the key its record names.
    ``own``: a contribution's payload key and tensors the caller holds (not downloaded
    again); ``out``: float32 buffers for the sums."""
    buffers = frozenset(spec.name for spec in specs if spec.kind == p.BUFFER)
    members = [
        Member(
            c.learner,
            c.samples,
            c.payload,
            own[1] if own is not None and c.payload == own[0] else None,
        )
        for c in sorted(commit.contributors, key=lambda c: c.learner)
    ]
    sums = out
    if sums is None:
        sums = {spec.name: torch.empty(size=spec.shape, dtype=torch.float32) for spec in specs}
    key = p.round_key(commit.round)
    try:
        await weighted_sums(box, algorithm, specs, buffers, members, commit.closer, sums)
    except Unusable as exc:
        raise ProtocolError(f"{key}: {exc.cause}") from exc
    params = await asyncio.to_thread(_finish, algorithm, base, sums, buffers)
    if commit.stored:
        found = await stored_key(box, params, commit.params)
    else:
        found = await asyncio.to_thread(_key, params)
    if found != commit.params:
        raise ProtocolError(
            f"{key}: the parameters computed from its contributions are not the ones its "
            "record names"
        )
    return params


async def commit_tensors(
    box: Mailbox,
    algorithm: Algorithm | None,
    specs: Sequence[p.TensorSpec],
    commit: p.Commit,
    *,
    purpose: str = DOWNLOAD,
    deadline: float | None = None,
) -> dict[str, torch.Tensor]:
    """``commit``'s parameters (a run-wide commit's: float32, ``p.outer_specs``):
    downloaded when stored, else computed along the chain from the newest stored commit
    before it with ``algorithm`` (``ProtocolError`` naming what is missing). ``specs``:
    the fragment's layout, in the model's dtypes (what its contributions carry)."""
    stored = p.outer_specs(specs)
    if commit.stored:
        return await retrying(
            partial(get_tensors, box, commit.params, stored, purpose=purpose), deadline=deadline
        )
    if algorithm is None:
        raise ValueError("commit_tensors: an unstored commit needs the run's algorithm")
    chain = [commit]
    while not chain[-1].stored:
        base = chain[-1].base
        if base is None or len(chain) > MAX_CHAIN:
            raise ProtocolError(
                f"{p.round_key(commit.round)}: no stored commit of its fragment before it"
            )
        key = p.round_key(base)
        data = await retrying(partial(box.get, key), deadline=deadline)
        chain.append(p.decode_commit(key, data))
    params: Mapping[str, torch.Tensor] = await retrying(
        partial(get_tensors, box, chain[-1].params, stored, purpose=purpose), deadline=deadline
    )
    for step in reversed(chain[:-1]):
        params = await retrying(
            partial(step_from_contributions, box, algorithm, specs, step, params),
            deadline=deadline,
        )
    return dict(params)


def _finish(
    algorithm: Algorithm,
    base: Mapping[str, torch.Tensor],
    sums: dict[str, torch.Tensor],
    buffers: frozenset[str],
) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return algorithm.finish(base, None, sums, buffer_names=buffers)[0]


def _key(params: Mapping[str, torch.Tensor]) -> str:
    from gradientmail.payload import payload_key

    return payload_key(params)
