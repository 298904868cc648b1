"""Lightning (``lightning.pytorch``) as a GradientMail learner: :class:`GradientMailCallback`.

::

    callback = GradientMailCallback(mailbox=box, algorithm=gm.DiLoCo(), learner_id="node-0")
    trainer = L.Trainer(max_steps=1000, callbacks=[callback])
    trainer.fit(module, loader)

What each hook does (docs/training.md, "The Hugging Face Trainer and Lightning"):

- ``on_fit_start`` (after the strategy set the model and its optimizers up): the Session
  joins on the LightningModule, with its optimizer for resume when it has exactly one
  (``optimizer=`` overrides), then waits at the ``start`` barrier when ``start_parties``
  is given.
- ``on_train_batch_end``: when the batch ended with an optimizer step (``global_step``
  advanced: once per ``accumulate_grad_batches`` batches), ``session.step(samples=...)``
  with the examples of the batches since the previous step, counted from the batches
  themselves (Lightning's ``extract_batch_size``): this rank's own examples. Where the
  Trainer runs several ranks, they are one learner and the Session sums the ranks'
  ``samples`` (``session/_ranks.py``), so each rank passes only its own.
- ``on_save_checkpoint``: ``session.sync()``, then the checkpoint's ``state_dict`` is taken
  again: Lightning collects it before this hook, and the checkpoint must hold the run's
  model, not this node's drift.
- the loss: the mean of ``training_step``'s loss over each ``log_every_n_steps`` optimizer
  steps, as a ``{learner}: step N loss X`` line, which the live table of ``gradientmail
  run`` reads (``progress=False`` prints nothing).
- ``on_train_end``: ``session.close()`` (the last steps contributed, their commits waited
  for), before Lightning's teardown moves the model off its device; ``on_fit_end`` closes
  too if training ended without it. ``on_exception``: the learner leaves at once,
  contributing nothing more.

With a distributed strategy (DDP), every rank builds the same callback with the same
``learner_id``: the ranks of the default process group are one learner and the library
decides which rank talks to the mailbox.
"""

from __future__ import annotations

from typing import Any

from gradientmail.integrations import missing_extra

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.data import extract_batch_size
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] != "lightning":
        raise
    raise missing_extra("lightning", "lightning", exc) from None

import torch

from gradientmail.integrations._glue import GlueCallback

__all__ = ["GradientMailCallback"]


class GradientMailCallback(GlueCallback, pl.Callback):
    """Makes a ``lightning.pytorch.Trainer`` learner ``learner_id`` of the run in ``mailbox``
    (what each hook does: module docstring). Keywords besides those: ``start_parties``,
    ``start_timeout`` and ``progress``, as for the Hugging Face callback, then any
    :class:`~gradientmail.Session` keyword. While ``fit`` trains, :attr:`session` is its
    Session."""

    OWNER = "GradientMailCallback (lightning)"
    # Set again by on_fit_start.
    _stepped = 0  # trainer.global_step at the last session.step()
    _samples = 0  # this rank's examples since then
    _loss_sum = 0.0  # training_step losses since the last progress line
    _loss_steps = 0  # optimizer steps since then

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        self._glue.start(pl_module, optimizers[0] if len(optimizers) == 1 else None)
        self._stepped = trainer.global_step
        self._samples = 0
        self._loss_sum, self._loss_steps = 0.0, 0

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._samples += extract_batch_size(batch)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # Lightning divides it by accumulate_grad_batches: the sum over a step's batches
            # is that step's mean loss.
            self._loss_sum += float(loss.detach())
        if trainer.global_step == self._stepped:
            return  # an accumulation batch: the optimizer has not stepped
        steps = trainer.global_step - self._stepped
        self._stepped = trainer.global_step
        samples, self._samples = self._samples, 0
        self._glue.step(max(1, samples))
        self._loss_steps += steps
        every = int(getattr(trainer, "log_every_n_steps", 50))  # set by Trainer(), undeclared
        if (0 < every <= self._loss_steps) or trainer.global_step >= trainer.max_steps > 0:
            if trainer.local_rank == 0:
                self._glue.report(trainer.global_step, self._loss_sum / self._loss_steps)
            self._loss_sum, self._loss_steps = 0.0, 0

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._glue.session is None:
            return  # a checkpoint outside training (trainer.save_checkpoint after fit)
        self._glue.sync()
        # The tensors Lightning collected may be copies (sharded strategies gather them):
        # taken again, after the sync. Only where the keys are the module's own.
        fresh = pl_module.state_dict()
        if checkpoint.get("state_dict", {}).keys() == fresh.keys():
            checkpoint["state_dict"] = fresh

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._glue.close()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._glue.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._glue.abandon(exception)
