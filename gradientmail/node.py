"""The node program, and the node environment for scripts of your own.

``python -m gradientmail.node`` is the built-in node: it joins the ``start`` barrier, trains
a small model on synthetic regression data for ``GRADIENTMAIL_STEPS`` steps (printing the
loss), leaves the session and waits at the ``done`` barrier.

A training script of your own reads the environment the operator and ``gradientmail run``
give every node (:mod:`gradientmail.launch.env` documents each variable)::

    env = gradientmail.node.NodeEnv.from_environ()
    with env.session(model) as session:   # Session(model, algorithm=…, mailbox=…, …)
        ...
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from gradientmail.launch.env import NodeEnv, NodeEnvError

if TYPE_CHECKING:
    import torch

__all__ = ["NodeEnv", "NodeEnvError", "main"]


def _builtin_model() -> torch.nn.Module:
    import torch

    torch.manual_seed(0)  # every node builds the same model; the creator's values win anyway
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )


def main() -> int:
    """The built-in node: start barrier, train on synthetic data, done barrier."""
    import torch

    try:
        env = NodeEnv.from_environ()
    except ValueError as exc:
        print(f"gradientmail.node: {exc}", file=sys.stderr)
        return 2
    box = env.open_mailbox()
    barrier = env.barrier(box, poll_interval=0.5)
    model = _builtin_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1000 + env.node_index)
    teacher = torch.Generator().manual_seed(7)
    target = torch.randn(32, 1, generator=teacher)  # the same task on every node
    started = time.monotonic()
    with env.session(model, mailbox=box, poll_interval=0.2) as session:
        if "start" in env.barriers or env.nodes > 1:
            barrier.wait("start", parties=env.parties("start"))
        print(f"{env.learner_id}: joined, training {env.steps} steps", flush=True)
        for step in range(1, env.steps + 1):
            x = torch.randn(64, 32, generator=generator)
            y = torch.tanh(x @ target)
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            session.step(samples=len(x))
            if step % max(1, env.steps // 10) == 0 or step == env.steps:
                print(
                    f"{env.learner_id}: step {step} loss {loss.item():.4f} rounds "
                    f"{list(session.rounds)}",
                    flush=True,
                )
    if "done" in env.barriers or env.nodes > 1:
        barrier.wait("done", parties=env.parties("done"), timeout=600)
    print(f"{env.learner_id}: done in {time.monotonic() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
