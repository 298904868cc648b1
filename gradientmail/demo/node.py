"""The node program, and the node environment for scripts of your own.

``python -m gradientmail.demo.node`` is the built-in node, what ``gradientmail run`` starts
without a command of its own. It opens its :class:`~gradientmail.Session`, waits at the
``start`` barrier until every node of the run has joined (so no node trains ahead while
another is still importing torch), trains for ``GRADIENTMAIL_STEPS`` steps, leaves the
session and waits at the ``done`` barrier. A run that declares a barrier ``step-N``
(``spec.barriers``, ``GRADIENTMAIL_BARRIERS``) holds its nodes there right after step ``N``
until every party arrived: nodes lined up at a step, e.g. for a look at the run in the
middle of training. Its Session runs the run's algorithm
(``GRADIENTMAIL_ALGORITHM``: DiLoCo, or Moshpit's group rounds; the rest is the same for
both). What it trains is its *task* (``GRADIENTMAIL_TASK``):

- ``lm`` (the default): the byte-level transformer language model of the quality benchmark
  (:mod:`gradientmail.demo.lm`) on the Python standard library's own sources, node ``i`` on
  its own shard (by top-level package: the test suite, the tools and codecs, the other
  packages, the single-file modules), AdamW with warm-up and cosine decay. Every
  ``steps / reports`` steps it prints ``step N loss X`` (the mean training loss since its
  previous line); node 0 adds ``val Y``, its own local model's loss on the fixed
  validation windows that ``gradientmail run`` also evaluates the aligned model on, so
  the run can draw one node's curve beside the aligned model's. ``GRADIENTMAIL_LM``
  overrides the sizes as ``key=value`` pairs, comma-separated (:class:`LmSettings`'s
  fields: ``d_model=32,layers=1,context=64``). The defaults train for about a minute
  with three nodes on two cores.
- ``synthetic``: a small MLP regressing a fixed random teacher on random inputs; seconds
  per thousand steps, for tests that only need nodes that train.

Both variables are the built-in node's own settings, not part of the node contract:
``gradientmail run`` passes them from its environment to the nodes, the operator does not
(its pods run the default task).

A training script of your own reads the environment the operator and ``gradientmail run``
give every node (:mod:`gradientmail.launch.env` documents each variable)::

    env = gradientmail.NodeEnv.from_environ()   # gradientmail.launch.env.NodeEnv
    with env.session(model) as session:   # Session(model, algorithm=…, mailbox=…, …)
        ...
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradientmail.launch.env import NodeEnv, NodeEnvError

if TYPE_CHECKING:
    import torch

    from gradientmail.mailbox import Mailbox
    from gradientmail.patterns.barrier import Barrier

__all__ = [
    "LM_VAR",
    "NODE_SETTINGS",
    "TASKS",
    "TASK_VAR",
    "LmSettings",
    "NodeEnv",
    "NodeEnvError",
    "builtin_model",
    "lm_model",
    "main",
    "task_of",
]

TASK_VAR = "GRADIENTMAIL_TASK"
LM_VAR = "GRADIENTMAIL_LM"
NODE_SETTINGS = (TASK_VAR, LM_VAR)  # the built-in node's own variables (not the contract)
TASKS = ("lm", "synthetic")


@dataclass(frozen=True)
class LmSettings:
    """The language model task's sizes. The defaults: 141k parameters, batches of 12
    windows of 128 bytes; ``gradientmail run``'s 800 steps per node take three nodes
    sharing two cores about a minute."""

    d_model: int = 64
    layers: int = 2
    heads: int = 4
    context: int = 128
    batch: int = 12
    lr: float = 3e-3
    eval_windows: int = 64  # fixed validation windows (aligned model, node 0's own)
    reports: int = 20  # progress lines per run (node 0 evaluates at each)
    max_bytes: int = 0  # read at most about this much of the stdlib per shard (0: all)
    seed: int = 1234

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> LmSettings:
        """The defaults with ``GRADIENTMAIL_LM``'s ``key=value`` overrides."""
        text = environ.get(LM_VAR, "")
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in (part.strip() for part in text.split(",") if part.strip()):
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or key not in fields:
                raise NodeEnvError(
                    f"{LM_VAR}: {item!r} is not key=value with a key among {', '.join(fields)}"
                )
            kind = float if fields[key] == "float" else int
            try:
                values[key] = kind(raw)
            except ValueError:
                raise NodeEnvError(f"{LM_VAR}: {key}={raw!r} is not a {kind.__name__}") from None
        settings = cls(**values)
        positive = [k for k, v in dataclasses.asdict(settings).items() if k != "max_bytes"]
        bad = [k for k in positive if dataclasses.asdict(settings)[k] <= 0]
        if bad or settings.max_bytes < 0:
            raise NodeEnvError(f"{LM_VAR}: {', '.join(bad or ['max_bytes'])} must be positive")
        if settings.d_model % settings.heads:
            raise NodeEnvError(
                f"{LM_VAR}: d_model {settings.d_model} is not a multiple of heads {settings.heads}"
            )
        return settings

    def corpus(self) -> dict[str, Any]:
        """The arguments of :func:`gradientmail.demo.lm.cached_corpus`."""
        return {
            "context": self.context,
            "eval_windows": self.eval_windows,
            "seed": self.seed,
            "max_bytes": self.max_bytes or None,
        }

    def describe(self) -> str:
        return (
            f"byte-level LM d_model {self.d_model}, {self.layers} layers, context "
            f"{self.context}, batch {self.batch}"
        )


def task_of(environ: Mapping[str, str]) -> str:
    """``GRADIENTMAIL_TASK`` (``lm`` when unset); an unknown task is a :class:`NodeEnvError`."""
    task = environ.get(TASK_VAR, "") or "lm"
    if task not in TASKS:
        raise NodeEnvError(f"{TASK_VAR}={task!r}: the built-in node knows {', '.join(TASKS)}")
    return task


def builtin_model(environ: Mapping[str, str]) -> torch.nn.Module:
    """The model the built-in node trains under ``environ`` (its initial values: every
    node builds the same, and the creator's values win anyway)."""
    import torch

    if task_of(environ) == "lm":
        return lm_model(LmSettings.from_environ(environ))
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )


def lm_model(s: LmSettings) -> torch.nn.Module:
    """The language model task's model under ``s`` (what the nodes train and what
    ``gradientmail run`` aligns to evaluate)."""
    from gradientmail.demo import lm

    return lm.build_model(lm.ModelSize(s.d_model, s.layers, s.heads), s.context, s.seed)


def _start(env: NodeEnv, barrier: Barrier, resumed: int) -> None:
    """Every node joined before any trains: the creator would otherwise be hundreds of
    steps ahead of a node still importing torch, and commit rounds alone. ``resumed``: the
    step count this learner continues from (its newest resume save; 0 for a new one)."""
    if "start" in env.barriers or env.nodes > 1:
        barrier.wait("start", parties=env.parties("start"))
    if resumed:
        print(
            f"{env.learner_id}: joined, resumed at step {resumed}, training to step {env.steps}",
            flush=True,
        )
    else:
        print(f"{env.learner_id}: joined, training {env.steps} steps", flush=True)


def _hold(env: NodeEnv, barrier: Barrier, step: int) -> None:
    """Wait at the barrier ``step-{step}`` when the run declares one (module docstring)."""
    name = f"step-{step}"
    if name in env.barriers:
        barrier.wait(name, parties=env.parties(name))


def _synthetic(env: NodeEnv, box: Mailbox, barrier: Barrier) -> None:
    import torch

    model = builtin_model({TASK_VAR: "synthetic"})
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1000 + env.node_index)
    teacher = torch.Generator().manual_seed(7)
    target = torch.randn(32, 1, generator=teacher)  # the same task on every node
    # optimizer=: a node restarted after a crash continues its optimizer state and its
    # step count from its newest save (Session resume), not from step 1.
    with env.session(model, mailbox=box, poll_interval=0.2, optimizer=optimizer) as session:
        _start(env, barrier, session.steps)
        for step in range(session.steps + 1, env.steps + 1):
            x = torch.randn(64, 32, generator=generator)
            y = torch.tanh(x @ target)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            session.step(samples=len(x))
            _hold(env, barrier, step)
            if step % max(1, env.steps // 10) == 0 or step == env.steps:
                print(
                    f"{env.learner_id}: step {step} loss {loss.item():.4f} rounds "
                    f"{list(session.rounds)}",
                    flush=True,
                )


def _language_model(env: NodeEnv, box: Mailbox, barrier: Barrier, s: LmSettings) -> None:
    from gradientmail.demo import lm

    shards, val = lm.cached_corpus(**s.corpus())
    shard = lm.node_shard(shards, env.node_index, env.nodes)
    model = lm_model(s)
    optimizer = lm.make_optimizer(model, s.lr)
    batches = lm.Batches(shard, env.node_index, s.batch, s.context, s.seed)
    every = max(1, env.steps // s.reports)
    local_curve = env.node_index == 0  # one node's own curve; the others train only
    with env.session(model, mailbox=box, poll_interval=0.2, optimizer=optimizer) as session:
        _start(env, barrier, session.steps)
        if local_curve and not session.steps:
            print(f"{env.learner_id}: step 0 val {lm.evaluate(model, val):.4f}", flush=True)
        losses: list[float] = []
        for step in range(session.steps + 1, env.steps + 1):
            lr = lm.lr_at(step, env.steps, s.lr)
            losses.append(lm.train_step(model, optimizer, batches.next(), lr))
            session.step(samples=s.batch)
            _hold(env, barrier, step)
            if step % every == 0 or step == env.steps:
                val_text = f" val {lm.evaluate(model, val):.4f}" if local_curve else ""
                print(
                    f"{env.learner_id}: step {step} loss {sum(losses) / len(losses):.4f}"
                    f"{val_text} rounds {list(session.rounds)}",
                    flush=True,
                )
                losses.clear()


def main() -> int:
    """The built-in node: start barrier, train its task, done barrier."""
    import os

    try:
        env = NodeEnv.from_environ()
        task = task_of(os.environ)
        settings = LmSettings.from_environ(os.environ) if task == "lm" else None
    except ValueError as exc:
        print(f"gradientmail.demo.node: {exc}", file=sys.stderr)
        return 2
    box = env.open_mailbox()
    barrier = env.barrier(box, poll_interval=0.5)
    started = time.monotonic()
    if settings is None:
        _synthetic(env, box, barrier)
    else:
        _language_model(env, box, barrier, settings)
    if "done" in env.barriers or env.nodes > 1:
        barrier.wait("done", parties=env.parties("done"), timeout=600)
    print(f"{env.learner_id}: done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
