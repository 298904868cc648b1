"""The Hugging Face ``Trainer`` as a GradientMail learner: :class:`GradientMailCallback`.

::

    callback = GradientMailCallback(mailbox=box, algorithm=gm.DiLoCo(), learner_id="node-0")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()

What each hook does (docs/training.md, "The Hugging Face Trainer and Lightning"):

- ``on_train_begin``: the Session joins on the Trainer's model (a ``DistributedDataParallel``
  wrapper unwrapped), with the Trainer's optimizer for resume unless ``optimizer=`` says
  otherwise, then waits at the ``start`` barrier when ``start_parties`` is given.
- ``on_step_end`` (after each optimizer step, so once per ``gradient_accumulation_steps``
  micro-batches): ``session.step(samples=...)`` with the examples the learner consumed in
  that step on this process: ``train_batch_size × gradient_accumulation_steps`` (the
  per-device batch, times the GPUs of a ``DataParallel`` process, times the micro-batches
  of one step). Where the Trainer runs several processes, they are one learner and the
  Session sums the ranks' ``samples`` (``session/_ranks.py``), so each passes only its
  own. The last step of an epoch may have fewer examples and still counts whole unless
  ``dataloader_drop_last``; ``auto_find_batch_size`` is not followed.
  Then, when the Trainer is about to save a checkpoint or evaluate
  (``control.should_save`` / ``should_evaluate``, set by its flow callback just before),
  ``session.sync()``: the checkpoint and the evaluation hold the run's model, not this
  node's drift.
- ``on_epoch_end``: the same sync before an epoch's save or evaluation.
- ``on_log``: the Trainer's training loss as a ``{learner}: step N loss X`` line, which the
  live table of ``gradientmail run`` reads (``progress=False`` prints nothing).
- ``on_train_end``: ``session.close()`` (the last steps contributed, their commits waited
  for): the model the Trainer holds afterwards is the run's newest.

With the Trainer's own distributed setup (``torchrun``, ``accelerate launch``), every rank
builds the same callback with the same ``learner_id``: the ranks of the default process
group are one learner and the library decides which rank talks to the mailbox.
"""

from __future__ import annotations

from typing import Any

from gradientmail.integrations import missing_extra

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ModuleNotFoundError as exc:
    if (exc.name or "").partition(".")[0] != "transformers":
        raise
    raise missing_extra("transformers", "transformers", exc) from None

from gradientmail.integrations._glue import GlueCallback

__all__ = ["GradientMailCallback", "samples_per_step"]


def samples_per_step(args: TrainingArguments) -> int:
    """The examples one optimizer step of the Trainer consumes on this process (the rule in
    the module docstring; the Session sums them over the learner's ranks)."""
    return int(args.train_batch_size * args.gradient_accumulation_steps)


class GradientMailCallback(GlueCallback, TrainerCallback):
    """A ``transformers.Trainer`` training as learner ``learner_id`` of the run in
    ``mailbox`` (the hooks: module docstring). ``options``: ``start_parties`` (wait at the
    ``start`` barrier until that many learners joined), ``start_timeout`` (600 s),
    ``progress`` (print the loss lines, ``True``) and any :class:`~gradientmail.Session`
    keyword (``overlap``, ``optimizer=None``, …). :attr:`session`: the open Session."""

    OWNER = "GradientMailCallback (transformers)"

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._glue.start(kwargs["model"], kwargs.get("optimizer"))

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._glue.step(samples_per_step(args))
        self._sync_before_save(control)

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._sync_before_save(control)

    def _sync_before_save(self, control: TrainerControl) -> None:
        # The Trainer's flow callback runs before this one and has just decided; the save or
        # evaluation follows these hooks (Trainer._maybe_log_save_evaluate).
        if control.should_save or control.should_evaluate:
            self._glue.sync()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        loss = (logs or {}).get("loss")
        if isinstance(loss, int | float) and state.is_local_process_zero:
            self._glue.report(state.global_step, float(loss))

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._glue.close()
