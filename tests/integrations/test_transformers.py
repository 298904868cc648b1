"""The Hugging Face Trainer's callback (``gradientmail/integrations/transformers.py``).

One shared run: two learners, each a Trainer of a tiny GPT-2 (random init, nothing
downloaded) that runs ``examples/snippets/hf_trainer.py`` (the README's snippet, as it is)
with the environment ``gradientmail run`` gives a node; gradient accumulation 2 and a
checkpoint at the last step. Checked: they commit rounds together; every optimizer step's
samples reach the commits (batch x accumulation); each checkpoint holds the run's newest
model (the callback synced before the save); the Trainer's loss reaches the lines the live
table reads. Plus the missing extra's one-line error.
"""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gradientmail.integrations.transformers as hf
from tests.integrations._learners import Learners, check_rounds, run_two

REPO = Path(__file__).resolve().parents[2]
SNIPPET = REPO / "examples" / "snippets" / "hf_trainer.py"
STEPS = 12  # optimizer steps per learner: sync_every 5 over 2 fragments
BATCH, ACCUMULATE = 4, 2
LOG_EVERY = 4


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)  # 1,272 parameters, lm_head tied to the embedding


def _learner(workdir: Path) -> dict[str, Any]:
    """One node: the snippet, given the model, the arguments and the data it leaves to you."""
    index = int(workdir.name[-1])
    tokens = torch.randint(0, 32, (64, 16), generator=torch.Generator().manual_seed(index))
    args = TrainingArguments(
        output_dir=str(workdir / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        logging_steps=LOG_EVERY,
        save_strategy="steps",
        save_steps=STEPS,  # one checkpoint, at the last step
        save_only_model=True,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=index,
    )
    names = {
        "model": _model(),
        "args": args,
        "train_dataset": [{"input_ids": t, "labels": t} for t in tokens],
    }
    ran = runpy.run_path(str(SNIPPET), init_globals=names, run_name="__main__")
    trainer: Trainer = ran["trainer"]
    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, hf.GradientMailCallback)
    )
    return {"closed": callback.session is None, "steps": trainer.state.global_step}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Learners:
    return run_two(
        tmp_path_factory.mktemp("hf"),
        _learner,
        prefix="hf",
        sync_every=5,
        fragments=2,
        steps=STEPS,
    )


def test_two_trainers_commit_rounds_together_with_every_steps_samples(run: Learners) -> None:
    assert all(r == {"closed": True, "steps": STEPS} for r in run.results.values()), run.results
    check_rounds(run, samples_per_learner=STEPS * BATCH * ACCUMULATE)


def test_each_checkpoint_holds_the_runs_newest_model(run: Learners) -> None:
    aligned = run.aligned(_model())
    for learner, workdir in run.workdirs.items():
        saved = load_file(str(workdir / "out" / f"checkpoint-{STEPS}" / "model.safetensors"))
        assert saved, learner
        for name, tensor in saved.items():
            assert torch.equal(tensor, aligned[name]), (learner, name)
    # Not the initial model: the checkpoint is trained (the rounds moved it).
    assert not torch.equal(
        aligned["transformer.h.0.mlp.c_fc.weight"],
        _model().state_dict()["transformer.h.0.mlp.c_fc.weight"],
    )


def test_the_trainers_loss_reaches_the_live_tables_lines(run: Learners) -> None:
    for learner in run.workdirs:
        lines = run.progress(learner)
        assert [step for step, _ in lines] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY)), lines
        assert all(0 < loss < 10 for _, loss in lines), lines  # ln(32) = 3.47 at the start


def test_without_the_extra_the_import_names_it_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "gradientmail.integrations.transformers")
    with pytest.raises(ImportError) as raised:
        importlib.import_module("gradientmail.integrations.transformers")
    message = str(raised.value)
    assert len(message.splitlines()) == 1, message
    assert "gradientmail[transformers]" in message
    assert "needs transformers" in message
