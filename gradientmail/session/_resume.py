"""Resuming a restarted learner (a component of the Session): its optimizer's state and
counters.

A learner that restarts gets the run's newest parameters at its join, but its optimizer
state (Adam's moments, SGD's momentum) and its counts lived in its process. With
``Session(optimizer=opt)`` it saves both to the mailbox, under keys of its own
(``resume/{learner}/{save}``), and a later ``Session`` with the same ``learner_id`` loads
them before its first step:

- **When.** Every ``optimizer_every`` of its sync points (default 10 per fragment: about
  every 10·``sync_every`` steps), and at ``close()``. A sync point is a quiet point: the
  optimizer has stepped, and with ``overlap=0`` the round's commit has been applied, so the
  parameters are the ones a restart loads and the saved state is the state they continue
  with.
- **Off the training thread.** ``step()`` only copies the state's tensors (host memory,
  charged to ``snapshots`` in the ledger) and hands the copy over; the communication thread
  encodes and uploads it in a task of its own, beside contributions and beats. A newer copy
  replaces one not yet uploaded (one copy at most waits). ``close()`` stores its copy
  itself, after the threads stopped.
- **Stored** as everything else: tensors in a content-addressed safetensors payload (no
  pickle: ``_optstate.py`` splits the state into those and tagged JSON), then the record
  naming it (create-once, fixed-width save number). Then the older saves are swept
  (``coord/sweep.py``: :func:`sweep_resume`): only the newest is kept.
- **Restored** at join, before the learner's first beat: the newest save is read, its
  optimizer class and parameter-group shapes compared with ``opt`` (a difference raises
  ``ValueError`` naming it, nothing is loaded), its payload verified, and the state loaded
  whole with ``load_state_dict``. A save that cannot be read (a corrupt payload, a missing
  one, a malformed record) is reported (``ResumeFailed``, a warning) and the learner starts
  fresh: a restart never wedges on its own leftovers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from gradientmail import wire as p
from gradientmail.coord.retry import Stopped, retrying
from gradientmail.coord.sweep import sweep_resume
from gradientmail.coord.threads import Wake, run_coroutine
from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import PayloadCorrupt, ProtocolError
from gradientmail.events import PollFailed, Resumed, ResumeFailed, ResumeSaved
from gradientmail.mailbox import Mailbox
from gradientmail.payload import get_tensors, put_tensors
from gradientmail.session._optstate import (
    RESUME_ID,
    decode_state,
    describe,
    differences,
    encode_state,
)
from gradientmail.session._state import Shared
from gradientmail.session._training import TrainingLoop
from gradientmail.wire.keys import parse_resume_key, resume_key, resume_prefix
from gradientmail.wire.resume import ResumeState, decode_resume

_UPLOAD_TICK = 0.25  # how often the upload task looks at the stop flag while idle
_FEEDBACK = "feedback/"  # a save's error-feedback tensors: feedback/{fragment}/{parameter}

_log = logging.getLogger("gradientmail")


@dataclass(eq=False)
class _Save:
    """A copy of the optimizer's state and the counters, taken on the training thread, for
    the communication thread to store (``record`` lacks its payload until then)."""

    key: str
    record: ResumeState
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Resume:
    """A learner's resume saves and restore (module docstring): its optimizer, the state its
    threads share, and the training loop whose counters it saves and restores."""

    def __init__(
        self,
        shared: Shared,
        training: TrainingLoop,
        box: Mailbox,
        layout: ModelLayout,
        optimizer: torch.optim.Optimizer | None,
        every: int | None,
        *,
        model: torch.nn.Module,
        compressing: bool,
        close_timeout: float,
    ) -> None:
        """Check ``optimizer`` (the model's, storable); everything is checked before
        anything is written."""
        if optimizer is not None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
                )
            mine = {id(param) for param in model.parameters()}
            if any(id(x) not in mine for g in optimizer.param_groups for x in g["params"]):
                raise ValueError("optimizer: it optimizes parameters that are not the model's")
            encode_state(optimizer.state_dict(), copy=False)  # TypeError: cannot be stored
        if every is None:
            every = 10 * layout.count
        if type(every) is not int or every < 1:
            raise ValueError(f"optimizer_every must be an int >= 1 (sync points), not {every!r}")
        self.shared, self.training, self.box, self.layout = shared, training, box, layout
        self.optimizer, self.every = optimizer, every
        self.compressing, self.close_timeout = compressing, close_timeout
        self._sync_points_seen = 0  # this life's sync points in step(), for optimizer_every
        self._next_save = 0  # the number of the next save (a restart numbers on)
        self._saved_step = 0  # the step of the newest state stored or restored
        self._save_waiting: _Save | None = None  # the copy the upload task stores next
        self.wake = Wake()

    # -- saving ------------------------------------------------------------------------------

    def point(self) -> None:
        """At each sync point of ``step()`` (training thread): every ``optimizer_every``-th,
        copy the state and hand it to the upload task."""
        self._sync_points_seen += 1
        if self._sync_points_seen % self.every:
            return
        save = self._capture()
        with self.shared.lock:
            self._save_waiting = save  # an older one not yet uploaded is dropped
        self.wake.set()

    def _capture(self) -> _Save:
        assert self.optimizer is not None
        with self.shared.lock:
            c = self.shared.counters
            # Only the sync points settled by now: a contribution still in flight (overlap)
            # has no outcome yet, and a restart would never learn it.
            inflight = list(self.shared.inflight.values())
            settled = c.sync_points - len(inflight)
            published = c.published - sum(1 for x in inflight if x.payload is not None)
            skipped, waited = c.skipped_syncs, c.waited_s
        kind, groups = describe(self.optimizer)
        tagged, tensors = encode_state(self.optimizer.state_dict())
        number = self._next_save
        key = resume_key(self.shared.learner_id, number)
        self._next_save += 1
        tensors[RESUME_ID] = torch.tensor(list(key.encode()), dtype=torch.uint8)
        # A compressing algorithm's error feedback (what this learner has not sent yet):
        # replaced, never changed in place, when a commit is applied on this thread.
        for fragment, residual in enumerate(self.shared.residual):
            for name, tensor in (residual or {}).items():
                tensors[f"{_FEEDBACK}{fragment}/{name}"] = tensor
        record = ResumeState(
            learner=self.shared.learner_id,
            save=number,
            step=self.training.steps,
            samples=self.training.samples,
            rounds=tuple(self.training.applied),
            optimizer=kind,
            groups=groups,
            state=tagged,
            payload="",
            nbytes=0,
            sync_points=max(settled, 0),
            contributed=max(published, 0),
            skipped=skipped,
            waited_s=round(waited, 3),
        )
        return _Save(key, record, tensors)

    async def uploads(self) -> None:
        """The communication thread's task: store each copy handed over, until stopped (a
        store in progress then finishes, or gives up at its first failure)."""
        while not self.shared.stop.is_set():
            with self.shared.lock:
                save, self._save_waiting = self._save_waiting, None
            if save is None:
                await self.wake.wait(_UPLOAD_TICK)
                self.wake.consume()
                continue
            try:
                await self._store_save(save, stop=self.shared.stop)
            except Stopped:
                return
            except Exception as exc:  # the next save tries again; training goes on
                self.shared.emit(
                    PollFailed(
                        self.shared.learner_id, error=f"storing resume save {save.key}: {exc!r}"
                    )
                )

    async def _store_save(
        self, save: _Save, *, stop: threading.Event | None = None, deadline: float | None = None
    ) -> None:
        """The payload, then the record naming it, then the sweep of older saves."""
        payload, nbytes = await retrying(
            partial(put_tensors, self.box, save.tensors), stop=stop, deadline=deadline
        )
        save.tensors = {}  # encoded and stored: the copies go
        record = replace(save.record, payload=payload, nbytes=nbytes)
        # Created once; a retried write that finds it is this learner's own earlier one (a
        # learner id is one process at a time, and numbers only grow).
        await retrying(
            partial(self.box.put_if_absent, save.key, p.encode(record)),
            stop=stop,
            deadline=deadline,
        )
        with self.shared.lock:
            self._saved_step = max(self._saved_step, record.step)
        self.shared.emit(
            ResumeSaved(self.shared.learner_id, key=save.key, step=record.step, nbytes=nbytes)
        )
        try:
            await sweep_resume(self.box, save.key, payload)
        except Stopped:
            raise
        except Exception as exc:  # housekeeping: the next save's sweep takes them too
            self.shared.emit(
                PollFailed(self.shared.learner_id, error=f"sweeping resume saves: {exc!r}")
            )

    def at_close(self) -> None:
        """``close()``, the threads stopped: store the state now, unless the newest stored
        one is already at this step. A failure is reported, never raised: the run's
        parameters are committed, only a restart's optimizer state is older."""
        if self.optimizer is None or self.training.steps == self._saved_step:
            return
        save = self._capture()
        deadline = time.monotonic() + self.close_timeout
        try:
            run_coroutine(self._store_save(save, deadline=deadline))
        except Exception as exc:
            self.shared.emit(
                PollFailed(self.shared.learner_id, error=f"storing resume save {save.key}: {exc!r}")
            )

    # -- restoring ---------------------------------------------------------------------------

    async def restore(self, deadline: float) -> None:
        """At join, before the first beat: load the newest save into the optimizer and the
        counters. ``ValueError`` when the optimizer does not match it; a save that cannot be
        read is reported and the learner starts fresh."""
        if self.optimizer is None:
            return
        saves = []
        listing = await retrying(
            partial(self.box.list, resume_prefix(self.shared.learner_id)), deadline=deadline
        )
        for key in listing:
            try:
                saves.append((parse_resume_key(key)[1], key))
            except ProtocolError:
                continue  # a stray key: not a save
        if not saves:
            return
        number, key = max(saves)
        self._next_save = number + 1
        try:
            data = await retrying(partial(self.box.get, key), deadline=deadline)
            record = decode_resume(key, data)
        except ProtocolError as exc:
            self._resume_failed(key, exc)
            return
        # A readable save of another optimizer is the caller's mistake, not damage: raised,
        # before anything is downloaded or loaded.
        found = differences(record.optimizer, record.groups, self.optimizer)
        if found:
            raise ValueError(
                f"learner {self.shared.learner_id}: its saved optimizer state ({key}) does not fit "
                f"this optimizer: {'; '.join(found)}. Pass the optimizer it was saved from, "
                "or another learner_id to start fresh"
            )
        try:
            tensors = await retrying(
                partial(get_tensors, self.box, record.payload), deadline=deadline
            )
            named = tensors.get(RESUME_ID, torch.empty(0, dtype=torch.uint8))
            if bytes(named.tolist()) != key.encode():
                raise ProtocolError(f"{key}: its payload {record.payload} is another record's")
            optimizer_tensors = {k: v for k, v in tensors.items() if not k.startswith(_FEEDBACK)}
            state = decode_state(key, record.state, optimizer_tensors)
            # Whole or not at all: load_state_dict builds the new state before it sets it,
            # and raises (ValueError, KeyError...) on a state that contradicts the record.
            self.optimizer.load_state_dict(state)
        except (ProtocolError, ValueError, KeyError, TypeError, IndexError) as exc:
            self._resume_failed(key, exc)
            return
        self._apply_counters(record)
        self._restore_feedback(key, tensors)
        step, samples, rounds = record.step, record.samples, record.rounds
        resumed = Resumed(self.shared.learner_id, key, step, samples, rounds)
        self.shared.emit(resumed)

    def _restore_feedback(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """The error feedback a save holds, per fragment, when it fits this model's layout
        (a fragment's whole, of its parameters' sizes); else that fragment starts from zero,
        with a warning: a save from a run with other settings."""
        if not self.compressing:
            return
        found: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if name.startswith(_FEEDBACK):
                number, _, param = name[len(_FEEDBACK) :].partition("/")
                if number.isdigit():
                    found.setdefault(int(number), {})[param] = tensor
        for fragment, residual in found.items():
            specs = self.layout.specs[fragment] if fragment < self.layout.count else ()
            wanted = {spec.name: math.prod(spec.shape) for spec in specs if spec.kind == p.PARAM}
            sizes = {name: t.numel() for name, t in residual.items()}
            if sizes != wanted or any(t.dtype != torch.float32 for t in residual.values()):
                _log.warning(
                    "%s: %s holds error feedback for fragment %d that does not fit this "
                    "model; it starts from zero",
                    self.shared.learner_id,
                    key,
                    fragment,
                )
                continue
            self.shared.residual[fragment] = {
                name: t.reshape(shape=(-1,)).clone() for name, t in residual.items()
            }

    def _resume_failed(self, key: str, exc: Exception) -> None:
        """Report a save that cannot be read; the learner starts fresh."""
        kind = "corrupt" if isinstance(exc, PayloadCorrupt) else "unreadable"
        reason = str(exc) if isinstance(exc, ProtocolError) else f"{key}: {exc!r}"
        error = f"{kind}, starting fresh: {reason}"
        self.shared.emit(ResumeFailed(self.shared.learner_id, key=key, error=error))

    def _apply_counters(self, record: ResumeState) -> None:
        """The counts continue from the save."""
        with self.shared.lock:
            self.training.resumed(record.step, record.samples)
            self._saved_step = record.step
            c = self.shared.counters
            c.sync_points, c.published = record.sync_points, record.contributed
            c.skipped_syncs, c.waited_s = record.skipped, record.waited_s
