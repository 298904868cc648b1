"""A tiny GPT-2 trained by the Hugging Face Trainer on every node of a GradientMail run.

    gradientmail run --nodes 2 -- python examples/hf_gpt2/train.py
    gradientmail run --nodes 2 --steps 300 -- python examples/hf_gpt2/train.py --out /tmp/hf

Nothing is downloaded: the model is built from a ``GPT2Config`` (random init, about 30,000
parameters, the output layer tied to the embedding) and the data is made here, a
synthetic language of 64 tokens in which each token is the one before it mapped by a fixed
permutation (the same for every node) except where noise replaces it (10%), so the loss
falls from ln 64 = 4.16 towards the noise's floor (about 0.75). Each node draws its own sequences
(its node index seeds them).

The node reads its run from the environment ``gradientmail run`` or the operator gives it
(``gm.NodeEnv``: mailbox, learner id, algorithm, ``GRADIENTMAIL_STEPS``) and trains with
:class:`gradientmail.integrations.transformers.GradientMailCallback`: the Session joins at
train begin, waits for the other nodes at the ``start`` barrier, steps after every
optimizer step (4 sequences x 2 accumulated micro-batches), syncs before every checkpoint
and closes at train end. The Trainer's loss appears in the live table of ``gradientmail
run``. At the end the node prints the held-out loss of the model it holds, which is the
run's newest. With ``--out DIR`` it saves a checkpoint halfway (synced first) and the final
model under ``DIR/{learner}/`` (``save_pretrained``: loads with ``from_pretrained``).
Needs the extra: ``pip install -e '.[torch,transformers]'`` in a checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gradientmail as gm
from gradientmail.integrations.transformers import GradientMailCallback

VOCAB, CONTEXT = 64, 32
NOISE = 0.1
BATCH, ACCUMULATE = 4, 2


def sequences(count: int, seed: int) -> torch.Tensor:
    """``count`` sequences of the synthetic language (module docstring)."""
    successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(64))
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.empty(count, CONTEXT, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (count,), generator=generator)
    for i in range(1, CONTEXT):
        tokens[:, i] = successor[tokens[:, i - 1]]
        noisy = torch.rand(count, generator=generator) < NOISE
        tokens[noisy, i] = torch.randint(0, VOCAB, (int(noisy.sum()),), generator=generator)
    return tokens


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)  # the run's creator commits its initial parameters; the rest load them
    return GPT2LMHeadModel(config)


@torch.no_grad()
def held_out_loss(model: GPT2LMHeadModel) -> float:
    model.eval()
    tokens = sequences(256, seed=10_000)  # no node trains on these
    loss = model(input_ids=tokens, labels=tokens).loss
    return float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="save a checkpoint and the final model here")
    options = parser.parse_args()

    env = gm.NodeEnv.from_environ()
    torch.set_num_threads(1)  # nodes share the machine's cores (docs/training.md)
    model = build_model()
    data = [{"input_ids": t, "labels": t} for t in sequences(4096, seed=env.node_index)]
    with tempfile.TemporaryDirectory(prefix="gm-hf-gpt2-") as scratch:
        out = options.out / env.learner_id if options.out else Path(scratch)
        args = TrainingArguments(
            output_dir=str(out),
            max_steps=env.steps,  # the live table's progress is out of GRADIENTMAIL_STEPS
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUMULATE,  # samples per step: 4 x 2
            learning_rate=3e-3,
            warmup_steps=min(20, env.steps // 10),
            logging_steps=max(1, env.steps // 20),
            save_strategy="steps" if options.out else "no",
            save_steps=max(1, env.steps // 2),
            save_only_model=True,
            report_to=[],
            disable_tqdm=True,
            dataloader_pin_memory=False,  # CPU nodes: nothing to pin for
            seed=env.node_index,
        )
        callback = GradientMailCallback(
            mailbox=env.open_mailbox(),
            algorithm=env.build_algorithm(),
            learner_id=env.learner_id,
            start_parties=env.parties("start"),
            **env.session_options(),
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        if options.out:
            trainer.save_model(str(out / "final"))
    report = {
        "learner": env.learner_id,
        "steps": trainer.state.global_step,
        "held_out_loss": round(held_out_loss(model), 4),
        "start_loss": round(math.log(VOCAB), 4),
    }
    print(f"{env.learner_id}: done: {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    main()
