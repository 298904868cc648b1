"""What both trainer callbacks do with one Session (:class:`Glue`), and the constructor
they share (:class:`GlueCallback`).

The callbacks only translate their trainer's hooks into these calls: start (the Session on
the trainer's model, the optimizer for resume, the start barrier), step, sync, close or
abandon, and the progress line the live table of ``gradientmail run`` reads.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from gradientmail.algorithms.base import Algorithm
from gradientmail.mailbox import Mailbox
from gradientmail.patterns.barrier import Barrier
from gradientmail.session import Session

__all__ = ["START_BARRIER", "Glue", "GlueCallback", "unwrap_model", "unwrap_optimizer"]

_log = logging.getLogger("gradientmail")

# The barrier `gradientmail run` and the operator size for every node (GRADIENTMAIL_BARRIERS).
START_BARRIER = "start"
_BARRIER_POLL = 0.2  # seconds between a waiting node's listings of the arrivals
DEFAULT_START_TIMEOUT = 600.0  # seconds a node waits at the start barrier


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a wrapper (``DistributedDataParallel``, ``DataParallel``) holds, so that
    parameter names match a learner of the bare model. The parameters are the same objects:
    what the Session loads, the wrapper trains."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    for _ in range(8):  # wrappers nest a few deep at most; bounded all the same
        if not isinstance(model, wrappers):
            break
        inner = model.module
        assert isinstance(inner, torch.nn.Module)
        model = inner
    return model


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer | None:
    """The torch optimizer a trainer's wrapper holds (accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``, Lightning's ``LightningOptimizer`` as ``._optimizer``): its
    class is what a resume save records, the same as a plain loop's. ``None`` if there is
    none."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class Glue:
    """One learner's Session, driven by a trainer's callback (module docstring).

    ``options`` are the callback's own keywords and :class:`~gradientmail.session.Session`
    keywords; ``optimizer=`` among them overrides the trainer's own (``optimizer=None``: no
    resume of the optimizer). The callback's own: ``start_parties``: after joining, wait at
    the mailbox barrier ``start`` until that many learners arrived (``start_timeout``
    seconds at most, 600 by default), so that no learner trains alone before the others
    joined; ``progress``: print ``{learner}: step N loss X`` lines, the ones the live table
    of ``gradientmail run`` reads (the Session itself carries no loss; ``True`` by default).
    """

    def __init__(
        self,
        owner: str,
        mailbox: Mailbox,
        algorithm: Algorithm,
        learner_id: str | None,
        options: dict[str, Any],
    ) -> None:
        # The trainer calls the hooks long after the callback is built: everything that can
        # be checked without the model is checked here, before the trainer starts.
        if not isinstance(mailbox, Mailbox):
            raise TypeError(f"{owner}: mailbox must be a gm.Mailbox, not {type(mailbox).__name__}")
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"{owner}: algorithm must be a gm.Algorithm such as gm.DiLoCo, not "
                f"{type(algorithm).__name__}"
            )
        parties = options.pop("start_parties", None)
        if parties is not None and (type(parties) is not int or parties < 1):
            raise ValueError(f"{owner}: start_parties must be None or an int >= 1, not {parties!r}")
        timeout = options.pop("start_timeout", DEFAULT_START_TIMEOUT)
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"{owner}: start_timeout must be a positive number of seconds")
        self.owner, self.mailbox, self.algorithm = owner, mailbox, algorithm
        self.learner_id, self.start_parties, self.start_timeout = learner_id, parties, timeout
        self.progress = bool(options.pop("progress", True))
        self.options = options  # the Session's keywords
        self.session: Session | None = None

    def start(self, model: torch.nn.Module, optimizer: object) -> Session:
        """Join the run with the trainer's model (unwrapped) and optimizer, then line up at
        the start barrier. A barrier that times out leaves the run again and raises."""
        if self.session is not None:
            raise RuntimeError(
                f"{self.owner}: training started again while its Session is open (one "
                "callback per trainer; a second training starts after the first ended)"
            )
        options = dict(self.options)
        if "optimizer" not in options:
            options["optimizer"] = unwrap_optimizer(optimizer)
        session = Session(
            unwrap_model(model),
            algorithm=self.algorithm,
            mailbox=self.mailbox,
            learner_id=self.learner_id,
            **options,
        )
        if self.start_parties is not None:
            barrier = Barrier(
                mailbox=self.mailbox, learner_id=session.learner_id, poll_interval=_BARRIER_POLL
            )
            try:
                barrier.wait(START_BARRIER, parties=self.start_parties, timeout=self.start_timeout)
            except BaseException as exc:
                session.__exit__(type(exc), exc, exc.__traceback__)  # leave, contributing nothing
                raise
        self.session = session
        return session

    def _open(self, what: str) -> Session:
        if self.session is None:
            raise RuntimeError(
                f"{self.owner}: {what} before training began (the Session starts with it)"
            )
        return self.session

    def step(self, samples: int) -> None:
        self._open("an optimizer step").step(samples=samples)

    def sync(self) -> None:
        self._open("a sync").sync()

    def close(self) -> None:
        """Contribute the last steps, wait for their commits, leave (``Session.close``)."""
        session, self.session = self.session, None
        if session is not None:
            session.close()

    def abandon(self, exc: BaseException) -> None:
        """Training raised: leave at once, contributing nothing more."""
        session, self.session = self.session, None
        if session is not None:
            session.__exit__(type(exc), exc, exc.__traceback__)

    def report(self, step: int, loss: float) -> None:
        if self.progress and self.session is not None:
            print(f"{self.session.learner_id}: step {step} loss {loss:.4f}", flush=True)


class GlueCallback:
    """The constructor and :attr:`session` both trainer callbacks share (each adds its own
    trainer's hooks, and its trainer's callback class as a second base)."""

    OWNER = "GradientMailCallback"  # what the errors name; each callback says which

    def __init__(
        self,
        *,
        mailbox: Mailbox,
        algorithm: Algorithm,
        learner_id: str | None = None,
        **options: Any,
    ) -> None:
        self._glue = Glue(self.OWNER, mailbox, algorithm, learner_id, options)

    @property
    def session(self) -> Session | None:
        """The open Session while training runs (``None`` before and after)."""
        return self._glue.session
