"""Lightning's callback (``gradientmail/integrations/lightning.py``).

One shared run: two learners, each a ``lightning.pytorch.Trainer`` of a small MLP that runs
``examples/snippets/lightning.py`` (the README's snippet, as it is) with the environment
``gradientmail run`` gives a node; the data's last batch of each epoch is short, and
Lightning saves a checkpoint at the end. Checked: they commit rounds together; the samples
of the batches themselves reach the commits; each checkpoint holds the run's newest model
(the callback synced before the save); the loss reaches the lines the live table reads.
Plus the missing extra's one-line error.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import gradientmail.integrations.lightning as gml
from tests.integrations._learners import Learners, check_rounds, run_two

REPO = Path(__file__).resolve().parents[2]
SNIPPET = REPO / "examples" / "snippets" / "lightning.py"
STEPS = 20  # optimizer steps per learner: sync_every 5 over 2 fragments
EXAMPLES, BATCH = 30, 4  # an epoch: 7 batches of 4 and one of 2
SAMPLES = 2 * EXAMPLES + 4 * BATCH  # 20 batches: two epochs (16 batches) and 4 more
LOG_EVERY = 10  # the snippet's log_every_n_steps


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16)
        )  # 2,128 parameters

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _learner(workdir: Path) -> dict[str, Any]:
    """One node: the snippet, given the module and the data it leaves to you."""
    generator = torch.Generator().manual_seed(int(workdir.name[-1]))
    x = torch.randn(EXAMPLES, 16, generator=generator)
    loader = DataLoader(TensorDataset(x, x.flip(1)), batch_size=BATCH, shuffle=True)
    names = {"module": Regression(), "train_loader": loader}
    ran = runpy.run_path(str(SNIPPET), init_globals=names, run_name="__main__")
    trainer: pl.Trainer = ran["trainer"]
    callback = next(c for c in trainer.callbacks if isinstance(c, gml.GradientMailCallback))
    checkpoint = trainer.checkpoint_callback
    assert isinstance(checkpoint, pl.callbacks.ModelCheckpoint)
    return {
        "closed": callback.session is None,
        "steps": trainer.global_step,
        "checkpoint": checkpoint.best_model_path or checkpoint.last_model_path,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Learners:
    return run_two(
        tmp_path_factory.mktemp("lightning"),
        _learner,
        prefix="pl",
        sync_every=5,
        fragments=2,
        steps=STEPS,
    )


def test_two_trainers_commit_rounds_together_with_the_batches_samples(run: Learners) -> None:
    for result in run.results.values():
        assert result["closed"], run.results
        assert result["steps"] == STEPS, run.results
    check_rounds(run, samples_per_learner=SAMPLES)


def test_each_checkpoint_holds_the_runs_newest_model(run: Learners) -> None:
    aligned = run.aligned(Regression())
    for learner, result in run.results.items():
        assert result["checkpoint"], result
        saved = torch.load(result["checkpoint"], weights_only=True)["state_dict"]
        assert saved.keys() == aligned.keys(), learner
        for name, tensor in saved.items():
            assert torch.equal(tensor, aligned[name]), (learner, name)
    assert not torch.equal(aligned["net.0.weight"], Regression().state_dict()["net.0.weight"])


def test_the_loss_reaches_the_live_tables_lines(run: Learners) -> None:
    for learner in run.workdirs:
        lines = run.progress(learner)
        assert [step for step, _ in lines] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), lines
        assert all(0 < loss < 10 for _, loss in lines), lines


def test_without_the_extra_the_import_names_it_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "lightning", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "gradientmail.integrations.lightning")
    with pytest.raises(ImportError) as raised:
        importlib.import_module("gradientmail.integrations.lightning")
    message = str(raised.value)
    assert len(message.splitlines()) == 1, message
    assert "gradientmail[lightning]" in message
    assert "needs lightning" in message
