"""Models and training steps the benchmarks share."""

from __future__ import annotations

import math
import time

import torch

BATCH = 32


def build_model(params: int, fragments: int = 1, seed: int = 0) -> torch.nn.Sequential:
    """A stack of square Linear layers holding about ``params`` float32 parameters."""
    layers = max(8, fragments)  # two tensors per layer: enough for every fragment
    width = max(16, round(math.sqrt(params / layers) / 16) * 16)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    return model


def mlp_1m(seed: int = 1) -> torch.nn.Sequential:
    """The reference training workload: a ~1M-parameter MLP (512 -> 1024 -> 512 -> 10)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 1_100_000
    return model


class MlpTrainer:
    """Forward + backward + SGD of :func:`mlp_1m` at batch 32 on the CPU."""

    def __init__(self, model: torch.nn.Module | None = None, seed: int = 1) -> None:
        self.model = model if model is not None else mlp_1m(seed)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(BATCH, 512, generator=generator)
        self.y = torch.randint(0, 10, (BATCH,), generator=generator)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()


def reference_step(steps: int, warmup: int = 20) -> list[float]:
    """Seconds per bare training step of :func:`mlp_1m` at batch 32 on the CPU."""
    trainer = MlpTrainer()
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        trainer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times
