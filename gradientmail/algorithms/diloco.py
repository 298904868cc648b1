"""DiLoCo with streaming fragments.

Each node trains locally. The model's parameters are split into ``fragments`` contiguous
groups; fragment ``f`` is due every ``sync_every`` steps, the fragments staggered by
``sync_every / fragments`` steps (Streaming DiLoCo), so one fragment is in flight at a
time and peak bandwidth drops by ``fragments``.

A round of fragment ``f`` combines the contributions it received:

    delta    = Σ samples_i · (global − local_i) / Σ samples_i      (pseudo-gradient)
    momentum = outer_momentum · momentum + delta
    update   = delta + outer_momentum · momentum   (Nesterov)  or  momentum (plain)
    global'  = global − outer_lr · update

With ``outer_lr=1, outer_momentum=0`` this is the sample-weighted average of the local
parameters.

Floating-point buffers (BatchNorm's running statistics) travel with their fragment but are
statistics, not weights: no pseudo-gradient, no outer step, no momentum (their momentum
entry stays zero). With ``buffers="average"`` (the default) a round sets each to the
contributions' plain sample-weighted average ``Σ samples_i · local_i / Σ samples_i``; with
``buffers="closer"`` to the closing learner's own copy (the first contributor in learner-id
order if the closer did not contribute).

With ``compression=`` (``gm.TopK``, ``gm.Cast``, ``gm.Quantize``) a learner contributes its
pseudo-gradient instead of its parameters, compressed with error feedback on its
communication thread (``algorithms/contribution.py``): ``e ← e + (global − local)``, it
sends ``C(e)`` and keeps ``e − D(C(e))``. The round's weighted sums are then the mean
decoded pseudo-gradient ``Δ̄`` itself, and the outer step reads
``momentum = μ·momentum + Δ̄``, ``global' = global − lr·(Δ̄ + μ·momentum)`` (Nesterov) or
``global − lr·momentum``.

A round is the engine's weighted sums (:meth:`DiLoCo.weights`: contributions in
learner-id order, float32) and :meth:`DiLoCo.finish` (the outer step), element-wise ops
only, so any process can recompute a commit from its round record and the previous commit
of its fragment and get the same bits.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

import torch

from gradientmail.algorithms.base import register
from gradientmail.algorithms.compression import Compression, compression_from_settings
from gradientmail.settings import algorithm_info, check
from gradientmail.wire import OUTER_DTYPE, TensorSpec

__all__ = ["BUFFER_MODES", "DiLoCo"]

BUFFER_MODES: tuple[str, ...] = algorithm_info("diloco").field("buffers").choices


@register
@dataclass(frozen=True)
class DiLoCo:
    sync_every: int = 100
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    buffers: str = "average"
    """How a round sets floating-point buffers: ``"average"`` (sample-weighted) or
    ``"closer"`` (the closer's own copy)."""
    compression: Compression | None = None
    """How contributions travel: None (the parameters, dense) or a compressor of the
    pseudo-gradient with error feedback (``gm.TopK``, ``gm.Cast``, ``gm.Quantize``)."""

    def __post_init__(self) -> None:
        # Kinds, bounds and the error text come from the registry (gradientmail/settings).
        check(type(self).__name__, algorithm_info(self.name).fields, self)
        if self.fragments > self.sync_every:
            raise ValueError(
                f"{type(self).__name__}(fragments={self.fragments}) cannot exceed sync_every="
                f"{self.sync_every}: each fragment needs its own due step"
            )
        _check_compression(type(self).__name__, self.compression)

    @property
    def name(self) -> str:
        return "diloco"

    @property
    def error_decay(self) -> float:
        """The error-feedback accumulator's decay between contributions (1: plain error
        feedback). Only read when ``compression`` is set."""
        return 1.0

    def settings(self) -> dict[str, Any]:
        """What the manifest records; every node must agree on all of it. ``buffers`` only
        when it is not the default, so runs created before it existed still match."""
        settings: dict[str, Any] = {
            "name": self.name,
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum,
            "nesterov": self.nesterov,
        }
        if self.buffers != "average":
            settings["buffers"] = self.buffers
        if self.compression is not None:
            settings["compression"] = self.compression.settings()
        return settings

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Self:
        values = {k: v for k, v in settings.items() if k != "name"}
        if "compression" in values:
            values["compression"] = compression_from_settings(values["compression"])
        return cls(**values)

    # -- schedule --------------------------------------------------------------------------

    def offset(self, fragment: int) -> int:
        """Local step (mod sync_every) at which ``fragment`` is due."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every

    def due_fragment(self, step: int) -> int | None:
        """The fragment due after local step ``step`` (1-based), if any."""
        phase = step % self.sync_every
        for fragment in range(self.fragments):
            if self.offset(fragment) == phase:
                return fragment
        return None

    def split(self, names_and_sizes: Sequence[tuple[str, int]]) -> list[list[str]]:
        """Split parameters (in model order) into ``fragments`` contiguous, balanced groups."""
        if len(names_and_sizes) < self.fragments:
            raise ValueError(
                f"the model has {len(names_and_sizes)} parameter tensors, fewer than "
                f"DiLoCo(fragments={self.fragments})"
            )
        total = sum(size for _, size in names_and_sizes)
        groups: list[list[str]] = [[] for _ in range(self.fragments)]
        filled = 0
        index = 0
        for position, (name, size) in enumerate(names_and_sizes):
            tensors_left = len(names_and_sizes) - position  # this one included
            groups_after = self.fragments - 1 - index
            # Move on once this group holds its share of the elements, or when the tensors
            # left are just enough to give every later group one.
            if (
                groups[index]
                and groups_after > 0
                and (filled >= total * (index + 1) / self.fragments or tensors_left == groups_after)
            ):
                index += 1
            groups[index].append(name)
            filled += size
        return groups

    # -- the round ---------------------------------------------------------------------------

    def state_specs(self, specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
        """The outer momentum: one tensor per tensor of the fragment, in its shape and in
        float32 (``OUTER_DTYPE``) whatever the parameters' dtype, as the global parameters
        a commit stores (a bfloat16 or float16 momentum of small outer steps would round
        them away; :meth:`finish` computes it in float32 and it is stored as computed).
        Buffers' entries stay zero."""
        return tuple(replace(spec, dtype=OUTER_DTYPE) for spec in specs)

    def weights(
        self, contributions: Sequence[tuple[str, int]], closer: str | None, /
    ) -> tuple[list[float], list[float]]:
        """Parameters: ``samples_i / Σ samples``. Buffers: the same (``"average"``), or all
        on the closer's copy (``"closer"``; the first contributor's in learner-id order if
        the closer did not contribute)."""
        total = float(sum(samples for _, samples in contributions))
        params = [samples / total for _, samples in contributions]
        if self.buffers != "closer":
            return params, params
        learners = [learner for learner, _ in contributions]
        chosen = learners.index(closer) if closer in learners else 0
        return params, [1.0 if i == chosen else 0.0 for i in range(len(learners))]

    def finish(
        self,
        base: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor] | None,
        mean: dict[str, torch.Tensor],
        /,
        *,
        state_out: dict[str, torch.Tensor] | None = None,
        buffer_names: Collection[str] = (),
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The outer step, in place in ``mean`` (the weighted average, which becomes the
        new parameters; a conversion of it for non-float32 parameters); the momentum into
        ``state_out`` when given (it may be ``state``'s own tensors: element-wise)."""
        momentum = state
        buffers = frozenset(buffer_names)
        new_params: dict[str, torch.Tensor] = {}
        new_momentum: dict[str, torch.Tensor] = {}
        lr, mu = self.outer_lr, self.outer_momentum
        for name, global_value in base.items():
            # dtype= by keyword, here and in the payload code: torch's positional overload
            # parsing leaves small Python blocks behind that wander with thread timing
            # (tests/payload/test_memory.py reads them as growth).
            g = global_value.to(dtype=torch.float32)  # itself when already float32
            acc = mean[name]
            m_out = None if state_out is None else state_out[name]
            if name in buffers:  # statistics: the average (or the closer's), no outer step
                new_params[name] = acc.to(dtype=global_value.dtype)
                new_momentum[name] = torch.zeros_like(g) if m_out is None else m_out.zero_()
                continue
            if self.compression is not None:
                # acc is the mean pseudo-gradient itself:  m = μ·m_old + acc
                if momentum is None:  # the first round: momentum starts at zero
                    m = acc.clone() if m_out is None else m_out.copy_(acc)
                else:
                    old = momentum[name].to(dtype=torch.float32)
                    m = old.mul(mu) if m_out is None else torch.mul(old, mu, out=m_out)
                    m.add_(acc)
                if self.nesterov:  # g − lr·acc − lr·μ·m
                    acc.mul_(-lr).add_(g).add_(m, alpha=-lr * mu)
                else:
                    acc.copy_(g).add_(m, alpha=-lr)  # g − lr·m
                new_params[name] = acc.to(dtype=global_value.dtype)
                new_momentum[name] = m
                continue
            # delta = g − avg;  m = μ·m_old + delta
            if momentum is None:  # the first round: momentum starts at zero
                m = torch.sub(g, acc) if m_out is None else torch.sub(g, acc, out=m_out)
            else:
                old = momentum[name].to(dtype=torch.float32)
                m = old.mul(mu) if m_out is None else torch.mul(old, mu, out=m_out)
                m.add_(g).sub_(acc)
            if self.nesterov:
                # g − lr·(delta + μ·m)  =  (1 − lr)·g + lr·avg − lr·μ·m
                acc.mul_(lr).add_(g, alpha=1 - lr).add_(m, alpha=-lr * mu)
            else:
                acc.copy_(g).add_(m, alpha=-lr)  # g − lr·m
            new_params[name] = acc.to(dtype=global_value.dtype)
            new_momentum[name] = m
        return new_params, new_momentum

    def combine(
        self,
        base: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor] | None,
        contributions: Sequence[tuple[str, int, Mapping[str, torch.Tensor]]],
        *,
        out: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
        buffer_names: Collection[str] = (),
        closer: str | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """New global parameters and momentum from ``(learner, samples, local)`` triples,
        whole tensors at a time (:func:`gradientmail.testing.reference.combine`: the
        weighted sums, then :meth:`finish`); the closer computes the same bits streaming.

        ``buffer_names``: the names in ``base`` that are floating-point buffers (the layout's
        kind ``buffer``): each becomes the plain sample-weighted average of the
        contributions (``buffers="average"``) or the copy of ``closer`` (``"closer"``), and
        its momentum entry zero; ``momentum`` may lack them. ``closer``: the learner that
        closes the round (the record's ``closer``; only ``buffers="closer"`` reads it).

        ``out``: ``(params, momentum)`` buffers to write into instead of allocating the two
        outputs, each with exactly the names of ``base``, float32, contiguous, on the
        parameters' device and of their shapes (``ValueError`` naming the tensor otherwise).
        ``out[0]`` is the accumulator: for float32 parameters the returned parameters are
        those buffers, for other dtypes a conversion of them. ``out[1][name]`` may be
        ``momentum[name]`` itself (the momentum update is element-wise, so it runs in
        place); no other output may share memory with an input or with another output.
        The results are bitwise the same with and without ``out``.
        """
        if out is not None:
            _check_out(base, momentum, [local for _, _, local in contributions], out)
        from gradientmail.testing.reference import combine  # the whole-tensor reference

        return combine(
            self,
            base,
            momentum,
            contributions,
            out=out,
            buffer_names=buffer_names,
            closer=closer,
        )


def _check_compression(owner: str, compression: object) -> None:
    from gradientmail.algorithms.compression import Compression

    if compression is not None and not isinstance(compression, Compression):
        raise ValueError(
            f"{owner}(compression={compression!r}) must be None or a compressor such as "
            "gm.TopK(density=0.02, bits=2), gm.Cast('bfloat16') or gm.Quantize(bits=8)"
        )


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` that ``tensor`` can touch (conservative for strided views)."""
    if tensor.numel() == 0:
        return 0, 0
    pairs = zip(tensor.shape, tensor.stride(), strict=True)
    extent = sum((size - 1) * stride for size, stride in pairs)
    start = tensor.data_ptr()
    return start, start + (extent + 1) * tensor.element_size()


def _check_out(
    base: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    locals_: Sequence[Mapping[str, torch.Tensor]],
    out: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    """Validate ``combine``'s ``out`` buffers; see its docstring."""
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError("out must be a (params, momentum) pair of dicts of tensors")
    outputs: list[tuple[int, int, str]] = []  # (start, end, label) of every output buffer
    for which, buffers in zip(("params", "momentum"), out, strict=True):
        if set(buffers) != set(base):
            missing = sorted(set(base) - set(buffers))[:3]
            extra = sorted(set(buffers) - set(base))[:3]
            raise ValueError(
                f"out {which}: names differ from the parameters (missing {missing}, "
                f"unexpected {extra})"
            )
        for name, buffer in buffers.items():
            label = f"out {which}[{name!r}]"
            want = base[name]
            if not isinstance(buffer, torch.Tensor):
                raise ValueError(f"{label} is a {type(buffer).__name__}, not a tensor")
            if buffer.dtype != torch.float32:
                raise ValueError(f"{label} is {buffer.dtype}; the outputs accumulate in float32")
            if buffer.shape != want.shape:
                raise ValueError(
                    f"{label} has shape {list(buffer.shape)}, the parameter {list(want.shape)}"
                )
            if buffer.device != want.device:
                raise ValueError(f"{label} is on {buffer.device}, the parameter on {want.device}")
            if not buffer.is_contiguous():
                raise ValueError(f"{label} is not contiguous")
            start, end = _span(buffer)
            if start != end:
                outputs.append((start, end, label))
    outputs.sort()
    for (_, end, first), (start, _, second) in itertools.pairwise(outputs):
        if start < end:
            raise ValueError(f"{first} and {second} share memory")
    starts = [start for start, _, _ in outputs]

    def overlapping(tensor: torch.Tensor) -> str | None:
        start, end = _span(tensor)
        if start == end:
            return None
        i = bisect.bisect_right(starts, start)  # outputs are disjoint: check two neighbours
        for j in (i - 1, i):
            if 0 <= j < len(outputs) and outputs[j][0] < end and start < outputs[j][1]:
                return outputs[j][2]
        return None

    inputs: list[tuple[str, Mapping[str, torch.Tensor]]] = [("the parameters", base)]
    inputs += [(f"contribution {i}", local) for i, local in enumerate(locals_)]
    if momentum is not None:
        inputs.append(("the momentum", momentum))
    for what, tensors in inputs:
        for name, tensor in tensors.items():
            if (
                momentum is not None
                and tensors is momentum
                and name in out[1]
                and _span(tensor) == _span(out[1][name])
                and tensor.stride() == out[1][name].stride()
                and tensor.dtype == torch.float32
            ):
                continue  # the momentum updated in place: element-wise, so allowed
            hit = overlapping(tensor)
            if hit is not None:
                raise ValueError(f"{hit} shares memory with {what}[{name!r}]")
