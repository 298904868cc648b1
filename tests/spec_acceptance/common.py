"""What spec 004's snippets take as given: a model, its optimizer, a dataloader, train_step.

The model has 8 parameter tensors, one per fragment of ``gm.DiLoCo(fragments=8)``. A batch
is one tensor of samples (inputs and target side by side), so that ``len(batch)`` is the
number of samples, as the snippet's ``session.step(samples=len(batch))`` assumes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

IN_FEATURES = 8
BATCH_SIZE = 16


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    )


def samples(seed: int, count: int) -> torch.Tensor:
    """``count`` rows of ``IN_FEATURES`` inputs and one target, from one fixed teacher."""
    teacher = torch.randn(IN_FEATURES, 1, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(count, IN_FEATURES, generator=torch.Generator().manual_seed(seed))
    return torch.cat([x, torch.sin(x @ teacher)], dim=1)


class Loader:
    """``steps`` batches of ``BATCH_SIZE`` rows, each after ``delay`` seconds (reading takes
    time), so that processes started together overlap."""

    def __init__(self, seed: int, steps: int, delay: float) -> None:
        self.rows = samples(seed, 2048)
        self.steps = steps
        self.delay = delay
        self.order = torch.Generator().manual_seed(seed + 1)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.steps):
            time.sleep(self.delay)
            yield self.rows[torch.randint(0, len(self.rows), (BATCH_SIZE,), generator=self.order)]


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor
) -> float:
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(batch[:, :IN_FEATURES]), batch[:, IN_FEATURES:])
    loss.backward()
    optimizer.step()
    return loss.item()


def loss_on(model: torch.nn.Module, seed: int = 99) -> float:
    rows = samples(seed, 512)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(
            model(rows[:, :IN_FEATURES]), rows[:, IN_FEATURES:]
        ).item()
