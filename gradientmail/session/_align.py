"""``align``: the run's newest committed parameters into a model, without joining."""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.algorithms.base import from_manifest
from gradientmail.algorithms.moshpit import Moshpit
from gradientmail.coord.retry import retrying
from gradientmail.coord.threads import run_coroutine
from gradientmail.engine.groups import aligned, describe_alignment
from gradientmail.engine.join import _wait_for, load_newest
from gradientmail.engine.layout import ModelLayout
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors

__all__ = ["align"]

_log = logging.getLogger("gradientmail")


async def _align(model: torch.nn.Module, box: Mailbox, timeout: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    manifest_bytes = await _wait_for(box, p.MANIFEST, deadline, "align")
    manifest = p.decode_manifest(p.MANIFEST, manifest_bytes)
    algorithm = from_manifest(manifest.algorithm)  # settings this release understands
    layout = ModelLayout.for_run(model, manifest)  # ProtocolError naming any difference
    rounds, tensors = await load_newest(box, layout, deadline, algorithm=algorithm)
    if manifest.frozen_payload is not None:
        frozen = await retrying(
            partial(get_tensors, box, manifest.frozen_payload, manifest.frozen), deadline=deadline
        )
        layout.load_frozen(frozen)
    if isinstance(algorithm, Moshpit):
        # Group rounds: the newest round's group commits, averaged (or the one they share).
        commits, params = await aligned(box, algorithm, layout)
        if params is not None:
            tensors, rounds = {0: params}, {0: commits[0].round}
        _log.info("align: loaded %s", describe_alignment(commits))
    for fragment, values in tensors.items():
        layout.load(fragment, values)
    return rounds


def align(model: torch.nn.Module, *, mailbox: Mailbox, timeout: float = 60.0) -> dict[int, int]:
    """Load the run's newest committed parameters into ``model`` without joining.

    Returns ``{fragment: round}`` of the commits loaded. For evaluation, or to start a new
    process from the run's current state. A Moshpit run has no run-wide commits: its
    newest group round's commits are averaged (sample-weighted), or loaded as they are when
    they all hold the same parameters; the log says which (``{0: group round}``).
    """
    return run_coroutine(_align(model, mailbox, timeout))
