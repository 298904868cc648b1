"""What every arm of the quality benchmark (``quality.py``) shares: the data, the model, one
training step, the evaluation, and the arms computed in one process.

The data, the model, the training step and the evaluation live in ``gradientmail.demo.lm``
(the built-in node trains the same model: ``gradientmail run``'s demo); they are re-exported
here under the names the benchmark has always used. This module adds the run sizes
(:class:`Sizes`), the benchmark's data files and the in-process arms.

- **Data**: the Python standard library's own ``.py`` sources (``sysconfig``'s ``stdlib``
  directory, ``site-packages`` left out), files in sorted order, byte-level tokens. Each file
  is cut into blocks of :data:`BLOCK` bytes; every 20th block of the whole sequence is held
  out for validation (5%, mixing all sources). The training blocks go to one of
  :data:`LEARNERS` shards by the file's top-level package or module (:func:`shard_of`), so
  the shards are non-IID on purpose. A learner samples windows of ``context + 1`` bytes
  from its own shard with a generator seeded by (seed, learner): every arm sees the same
  samples in the same order.
- **Model**: a small pre-LayerNorm causal transformer LM (:class:`TinyLM`): byte and
  position embeddings, ``layers`` blocks of multi-head attention and a 4x GELU MLP, a final
  LayerNorm and an untied head. No dropout, no buffers: every tensor is a parameter.
- **Training**: AdamW (betas 0.9/0.95, weight decay 0.01), linear warm-up over the first 5%
  of local steps, then cosine decay to 10%; one step is :func:`train_step`.
- **Evaluation**: the mean next-byte cross-entropy (nats per byte) over a fixed set of
  validation windows (:func:`evaluate`).
- **In-process arms** (:func:`run_inprocess`): ``ddp`` (one model, batch M·B, the M
  learners' batches side by side), ``reference`` (M model copies in one process, DiLoCo with
  zero latency through ``gm.DiLoCo.combine`` itself, Streaming DiLoCo's fragment schedule as
  the library has it), ``reference-late`` (the same with every outer step applied N inner
  steps late, keeping the local progress made meanwhile), ``solo-average`` (no syncs, the
  copies averaged once at the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradientmail.demo import lm as _shared
from gradientmail.demo.lm import (
    BLOCK,
    HOLDOUT,
    SEED,
    SHARD_NAMES,
    VOCAB,
    Batches,
    Block,
    Corpus,
    ModelSize,
    TinyLM,
    build_model,
    evaluate,
    load_params,
    lr_at,
    make_optimizer,
    param_count,
    shard_of,
    stdlib_files,
    train_step,
)

__all__ = [
    "BLOCK",
    "HOLDOUT",
    "LEARNERS",
    "SEED",
    "SHARD_NAMES",
    "VOCAB",
    "ArmResult",
    "Batches",
    "Block",
    "Corpus",
    "ModelSize",
    "Sizes",
    "TinyLM",
    "build_corpus",
    "build_model",
    "evaluate",
    "fragment_names",
    "learner_id",
    "load_data",
    "load_params",
    "lr_at",
    "make_optimizer",
    "param_count",
    "run_inprocess",
    "save_corpus",
    "shard_of",
    "stdlib_files",
    "tail_mean",
    "train_step",
]

LEARNERS = _shared.SHARDS  # M: one learner per shard


# -- sizes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Everything that sets a run's size; a worker process gets it as JSON."""

    model: ModelSize
    fast_model: ModelSize  # diloco-fast: steps of a few ms
    batch: int  # B per learner
    steps: int  # T/M local steps per learner
    fast_steps: int
    context: int = 128
    lr: float = 2e-3
    checkpoints: int = 8  # loss-curve points
    eval_windows: int = 512
    sync_every: tuple[int, ...] = (25, 100)
    fragments: tuple[int, ...] = (1, 4)
    threads: int = 1  # torch intra-op threads in every worker (the same everywhere: bitwise)
    seed: int = SEED
    max_stdlib_bytes: int | None = None  # tests: read at most about this much per shard

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sizes:
        values = dict(data)
        values["model"] = ModelSize(**values["model"])
        values["fast_model"] = ModelSize(**values["fast_model"])
        values["sync_every"] = tuple(values["sync_every"])
        values["fragments"] = tuple(values["fragments"])
        return cls(**values)

    def family(self, name: str) -> tuple[ModelSize, int]:
        """The model and local steps of a family: ``main`` or ``fast``."""
        return (self.fast_model, self.fast_steps) if name == "fast" else (self.model, self.steps)

    def checkpoint_steps(self, steps: int) -> list[int]:
        """Local steps after which the loss curve is evaluated (the last one is the end)."""
        k = max(1, min(self.checkpoints, steps))
        return sorted({max(1, round(steps * (c + 1) / k)) for c in range(k)})


# -- data ------------------------------------------------------------------------------------


def build_corpus(sizes: Sizes) -> Corpus:
    """Read the stdlib, cut it into blocks, hold out 5%, shard the rest by package."""
    return _shared.build_corpus(
        context=sizes.context,
        eval_windows=sizes.eval_windows,
        seed=sizes.seed,
        max_bytes=sizes.max_stdlib_bytes,
    )


def save_corpus(corpus: Corpus, path: Path) -> None:
    torch.save({"shards": corpus.shards, "val": corpus.val}, path)


def load_data(path: Path) -> tuple[list[torch.Tensor], torch.Tensor]:
    data = torch.load(path, weights_only=True)
    return list(data["shards"]), data["val"]


def learner_id(i: int) -> str:
    """The learner IDs of every arm (combine orders contributions by them)."""
    return f"learner-{i}"


# -- the in-process arms ---------------------------------------------------------------------


@dataclass
class ArmResult:
    arm: str
    family: str
    final_loss: float
    curve: list[tuple[int, float]]  # (samples, validation loss)
    wall_s: float
    train_loss: float  # mean over the last 10% of steps
    sync_points: int = 0
    rounds: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _schedule(algorithm: Any, fragments: int) -> dict[int, int]:
    """Local step (mod sync_every) -> the fragment due then, as the library schedules it."""
    return {algorithm.offset(f): f for f in range(fragments)}


def fragment_names(model: nn.Module, algorithm: Any) -> list[list[str]]:
    named = [(name, p.numel()) for name, p in model.named_parameters()]
    groups: list[list[str]] = algorithm.split(named)
    return groups


def run_inprocess(
    arm: str,
    sizes: Sizes,
    shards: Sequence[torch.Tensor],
    val: torch.Tensor,
    *,
    family: str = "main",
    sync_every: int = 25,
    fragments: int = 1,
    late: int = 0,
    tail: bool = False,
    save: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> ArmResult:
    """``ddp``, ``reference`` (``late`` = 0), ``reference-late`` (``late`` > 0) or
    ``solo-average``, on the ``family``'s model; evaluated at the checkpoints.

    ``tail``: at the end, every fragment with steps since its last sync point contributes
    them in one more round (what a ``close()`` that flushes does). ``save``: the final
    parameters go there (``torch.save`` of a name -> tensor dict).
    """
    import gradientmail as gm

    size, steps = sizes.family(family)
    m = LEARNERS
    checkpoints = set(sizes.checkpoint_steps(steps))
    batches = [Batches(shards[i], i, sizes.batch, sizes.context, sizes.seed) for i in range(m)]
    curve: list[tuple[int, float]] = []
    losses: list[float] = []
    started = time.perf_counter()
    extra: dict[str, Any] = {}
    say = progress or (lambda _: None)
    eval_s = [0.0]  # evaluation time, left out of the arm's wall time

    def measure(model: nn.Module) -> float:
        t = time.perf_counter()
        loss = evaluate(model, val)
        eval_s[0] += time.perf_counter() - t
        return loss

    if arm == "ddp":
        model = build_model(size, sizes.context, sizes.seed)
        opt = make_optimizer(model, sizes.lr)
        for s in range(1, steps + 1):
            tokens = torch.cat([b.next() for b in batches])
            losses.append(train_step(model, opt, tokens, lr_at(s, steps, sizes.lr)))
            if s in checkpoints:
                curve.append((s * m * sizes.batch, measure(model)))
                say(f"{arm}: step {s}/{steps}, loss {curve[-1][1]:.4f}")
        final_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        wall = time.perf_counter() - started - eval_s[0]
        result = ArmResult(arm, family, curve[-1][1], curve, wall, tail_mean(losses))
        _save(save, final_params)
        return result

    if arm not in ("reference", "reference-late", "solo-average"):
        raise ValueError(f"unknown in-process arm {arm!r}")
    sync = arm != "solo-average"
    algorithm = gm.DiLoCo(sync_every=sync_every, fragments=fragments)
    copies = [build_model(size, sizes.context, sizes.seed) for _ in range(m)]
    opts = [make_optimizer(c, sizes.lr) for c in copies]
    params = [dict(c.named_parameters()) for c in copies]
    groups = fragment_names(copies[0], algorithm)
    due = _schedule(algorithm, fragments)
    with torch.no_grad():
        globals_ = [{n: params[0][n].detach().clone() for n in g} for g in groups]
    momentum: list[dict[str, torch.Tensor] | None] = [None] * fragments
    last_sync = [0] * fragments  # local step of each fragment's last contribution
    # reference-late: (apply after local step, fragment, new global, each copy's snapshot)
    pending: list[tuple[int, int, dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]] = []
    sync_points = rounds = 0
    ids = [learner_id(i) for i in range(m)]
    eval_model = build_model(size, sizes.context, sizes.seed)
    eval_params = dict(eval_model.named_parameters())

    def combine(f: int, s: int) -> dict[str, torch.Tensor]:
        samples = (s - last_sync[f]) * sizes.batch
        contributions = [
            (ids[i], samples, {n: params[i][n].detach() for n in groups[f]}) for i in range(m)
        ]
        new, mom = algorithm.combine(globals_[f], momentum[f], contributions)
        globals_[f] = new
        momentum[f] = mom
        last_sync[f] = s
        return new

    def global_model() -> nn.Module:
        with torch.no_grad():
            if sync:
                for group in globals_:
                    for n, t in group.items():
                        eval_params[n].copy_(t)
            else:  # solo-average: the copies' mean
                for n, p in eval_params.items():
                    p.copy_(torch.stack([params[i][n].detach() for i in range(m)]).mean(0))
        return eval_model

    for s in range(1, steps + 1):
        lr = lr_at(s, steps, sizes.lr)
        step_losses = [train_step(copies[i], opts[i], batches[i].next(), lr) for i in range(m)]
        losses.append(sum(step_losses) / m)
        if sync:
            for _, f, new, snaps in [x for x in pending if x[0] == s]:
                with torch.no_grad():  # param <- new global + (param - snapshot), as rebase
                    for i in range(m):
                        for n in groups[f]:
                            params[i][n].add_(new[n]).sub_(snaps[i][n])
            pending = [x for x in pending if x[0] != s]
            f_due = due.get(s % sync_every)
            if f_due is not None:
                sync_points += 1
                rounds += 1
                if late == 0:
                    new = combine(f_due, s)
                    with torch.no_grad():  # exact DiLoCo: every copy takes the new global
                        for i in range(m):
                            for n in groups[f_due]:
                                params[i][n].copy_(new[n])
                else:
                    with torch.no_grad():
                        snaps = [
                            {n: params[i][n].detach().clone() for n in groups[f_due]}
                            for i in range(m)
                        ]
                    new = combine(f_due, s)
                    pending.append((s + late, f_due, new, snaps))
        if s in checkpoints:
            curve.append((s * m * sizes.batch, measure(global_model())))
            say(f"{arm}: step {s}/{steps}, loss {curve[-1][1]:.4f}")
    if sync and tail:
        # close(): the commits still in flight are applied first, then every fragment
        # contributes its steps since its last sync point.
        for _, f, new, snaps in sorted(pending, key=lambda x: x[0]):
            with torch.no_grad():
                for i in range(m):
                    for n in groups[f]:
                        params[i][n].add_(new[n]).sub_(snaps[i][n])
        pending = []
        for f in range(fragments):
            if last_sync[f] < steps:
                combine(f, steps)
                rounds += 1
        final = measure(global_model())
        curve[-1] = (curve[-1][0], final)
        extra["tail_rounds"] = True
    final_params = {n: p.detach().clone() for n, p in global_model().named_parameters()}
    result = ArmResult(
        arm,
        family,
        curve[-1][1],
        curve,
        time.perf_counter() - started - eval_s[0],
        tail_mean(losses),
        sync_points=sync_points,
        rounds=rounds,
        extra=extra,
    )
    _save(save, final_params)
    return result


def tail_mean(losses: Sequence[float]) -> float:
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def _save(path: Path | None, params: Mapping[str, torch.Tensor]) -> None:
    if path is not None:
        torch.save(dict(params), path)
