"""The whole-tensor reference of a round, for tests and benchmarks to compare with.

The closer (``engine/closer.py``) and ``verify`` stream a round's contributions from the
mailbox part by part (``engine/sums.py``), then call the algorithm's ``finish``. This
module computes the same two steps on whole tensors held in memory: :func:`weighted_sum`
(the contributions' weighted sums, in learner-id order, in float32) and :func:`combine`
(those sums, then ``finish``). Both are element-wise, so the results are the same bits as
the closer's; the tests check exactly that, and ``gm.DiLoCo.combine`` (the quality
benchmark's in-process reference) is this :func:`combine`.

As in a run, ``base`` (the previous global parameters) and the state are float32 whatever
the model's dtype (``wire.OUTER_DTYPE``); the contributions are what learners hold, in the
model's dtypes. A learner then loads the new float32 global into its parameters rounded by
``Tensor.to`` (``ModelLayout.load``).

Imports torch (``import gradientmail.testing`` does not load this module).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from gradientmail.algorithms.base import Algorithm, Contribution, Tensors, accumulate
from gradientmail.wire import BUFFER, PARAM, TensorSpec

__all__ = ["combine", "weighted_sum"]


def weighted_sum(
    algorithm: Algorithm,
    like: Mapping[str, torch.Tensor],
    contributions: Sequence[Contribution],
    *,
    buffer_names: Collection[str] = (),
    closer: str | None = None,
    out: Tensors | None = None,
) -> Tensors:
    """The contributions' weighted sums, whole tensors at a time (the closer streams the
    same sums part by part): float32, into ``out`` when given (zeroed first). With a
    compressing algorithm each contribution's tensors are its payload's
    (``algorithms/contribution.py``), decoded as the closer decodes them."""
    from gradientmail.algorithms.contribution import add_contribution, compression_of

    ordered = sorted(contributions, key=lambda c: c[0])
    params_w, buffers_w = algorithm.weights([(c[0], c[1]) for c in ordered], closer)
    buffers = frozenset(buffer_names)
    sums: Tensors = {}
    with torch.no_grad():
        for name, value in like.items():
            acc = (
                torch.zeros(value.shape, dtype=torch.float32, device=value.device)
                if out is None
                else out[name].zero_()
            )
            sums[name] = acc
        compressed = compression_of(algorithm)
        if compressed is not None:
            # A buffer travels dense in the model's dtype, which the (float32) globals in
            # ``like`` need not have: its spec takes the first contribution's.
            first = ordered[0][2] if ordered else {}
            specs = [
                TensorSpec(
                    name,
                    tuple(v.shape),
                    str(first[name].dtype if name in buffers and name in first else v.dtype),
                    BUFFER if name in buffers else PARAM,
                )
                for name, v in like.items()
            ]
            flat = {name: acc.view(size=(-1,)) for name, acc in sums.items()}
            for i, (learner, _, payload) in enumerate(ordered):
                by_name = {n: buffers_w[i] if n in buffers else params_w[i] for n in like}
                add_contribution(
                    compressed[0], flat, payload, by_name, specs, buffers, where=learner
                )
            return sums
        for name, acc in sums.items():
            weights = buffers_w if name in buffers else params_w
            for (_, _, local), weight in zip(ordered, weights, strict=True):
                accumulate(acc, local[name], weight)
    return sums


def combine(
    algorithm: Algorithm,
    base: Mapping[str, torch.Tensor],
    state: Mapping[str, torch.Tensor] | None,
    contributions: Sequence[Contribution],
    *,
    out: tuple[Tensors, Tensors] | None = None,
    buffer_names: Collection[str] = (),
    closer: str | None = None,
) -> tuple[Tensors, Tensors]:
    """A round's commit from whole tensors: :func:`weighted_sum`, then ``finish``.
    ``out``: ``(sums, state)`` buffers written instead of allocating (the sums become the
    parameters where they are float32); see ``DiLoCo.combine`` for what is checked."""
    if not contributions:
        raise ValueError("a round needs at least one contribution")
    buffers = frozenset(buffer_names)
    unknown = sorted(buffers - base.keys())
    if unknown:
        raise ValueError(f"buffer_names {unknown[:3]} are not among the tensors combined")
    sums = weighted_sum(
        algorithm,
        base,
        contributions,
        buffer_names=buffers,
        closer=closer,
        out=None if out is None else out[0],
    )
    with torch.no_grad():
        return algorithm.finish(
            base, state, sums, state_out=None if out is None else out[1], buffer_names=buffers
        )
