"""A learner made of many ranks: the ranks of a ``torch.distributed`` group train ONE
learner (a node of several GPUs running DDP inside).

Every rank constructs the Session and calls ``step()`` (``sync()``, ``close()``) the same
way, with the same learner id. Rank 0 of the group, the *leader*, is the only one that
talks to the mailbox: it joins, beats, publishes, closes rounds and applies commits, as a
learner of one process does. After each of those calls it tells the other ranks (the
*followers*) what happened, in one fixed sequence of collectives (:meth:`RankGroup.mirror`):

1. ``step()`` only: an ``all_reduce`` of the ranks' ``samples`` (the learner's step is over
   the samples of all its ranks);
2. a ``broadcast`` of a fixed-size header from the leader: its status (ok, or which error it
   raised), its step and sample counts, the round applied per fragment, and which
   fragments it changed;
3. a ``broadcast`` of every tensor of each changed fragment (at the join, of every tensor
   the run holds, frozen ones too), in layout order, one flat buffer per dtype and device;
4. when the leader raised: a ``broadcast`` of its error text; then every rank raises.

So every rank holds, bitwise, the leader's parameters after every call (DDP never
re-broadcasts parameters that ``step()`` replaced: without this the ranks drift apart from
the first commit on). A collective that fails (another rank of this learner died, or went
silent past the group's timeout) raises :class:`RanksFailed` from the call on every
surviving rank; the Session then leaves without contributing.

The construction starts with a handshake (:meth:`RankGroup.agree`): the leader's learner id
and a signature of its model layout and settings go to every rank, and a rank that differs
makes every rank raise the same ``ProtocolError``.

Sharded models (FSDP2 ``fully_shard``, DTensor parameters) are refused for now
(:func:`learner_model`).
"""

from __future__ import annotations

import json
import sys
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradientmail.engine.layout import ModelLayout
from gradientmail.errors import ProtocolError, RanksFailed
from gradientmail.session._training import TrainingLoop

__all__ = ["RankGroup", "learner_model"]

_ID_BYTES = 128  # a learner id's longest (wire.check_learner_id)
_TEXT_BYTES = 4000  # the most of a leader's error text sent to the followers
# Header slots (int64), then `applied` and `changed`, one slot per fragment each.
_STATUS, _KIND, _STEPS, _SAMPLES, _TEXT = range(5)
_HEAD = 5
# What a leader raised, as the followers raise it (anything else: RuntimeError).
_KINDS: tuple[type[Exception], ...] = (RuntimeError, ProtocolError, TimeoutError, ValueError)


def learner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose tensors travel: a ``DistributedDataParallel`` wrapper's ``.module``,
    so the names match a learner of one process training the same model. Sharded
    parameters (DTensor: FSDP2 ``fully_shard``, tensor parallelism) are refused."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    # Importing torch.distributed.tensor costs seconds of CPU: a model holds a DTensor
    # only when something imported that module already.
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                raise NotImplementedError(
                    f"parameter {name!r} is a DTensor (FSDP2 fully_shard or tensor "
                    "parallelism): learners of sharded models are not supported yet; wrap "
                    "the model in DistributedDataParallel (replicated), or train each rank "
                    "as a learner of its own"
                )
    return model


def _signature(layout: ModelLayout, settings: dict[str, Any]) -> int:
    """A checksum of what every rank must agree on: the tensors that travel (names, shapes,
    dtypes, kinds, fragments) and the Session's settings."""
    text = json.dumps(
        [
            [[spec.name, spec.shape, spec.dtype, spec.kind] for spec in fragment]
            for fragment in (*layout.specs, layout.frozen_specs)
        ]
        + [settings],
        sort_keys=True,
        default=str,
    )
    return zlib.crc32(text.encode())


@dataclass(frozen=True)
class RankGroup:
    """The ranks of one learner: ``group`` (a process group), this process's ``rank`` in it
    and their number ``size``; rank 0 is the leader."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> RankGroup | None:
        """The learner's ranks: ``group``, or the default group when ``torch.distributed``
        is initialized; None for a learner of one process."""
        if group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("Session(group=...) needs torch.distributed initialized first")
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            group = dist.group.WORLD
            assert group is not None
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("Session(group=...): this process is not a rank of that group")
        size = dist.get_world_size(group)
        return None if size == 1 else cls(group, rank, size)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- the handshake -----------------------------------------------------------------------

    def agree(
        self,
        learner_id: str | None,
        default_id: Callable[[], str],
        layout: ModelLayout,
        settings: dict[str, Any],
    ) -> str:
        """The learner id of every rank: the leader's (``learner_id``, or ``default_id()``
        when it was given none). ``ProtocolError`` on every rank when a rank was given
        another id, or differs in model layout or settings."""
        device = _device(layout)
        head = torch.zeros(2 + _ID_BYTES, dtype=torch.int64, device=device)
        signature = _signature(layout, settings)
        if self.leader:
            raw = (learner_id or default_id()).encode()
            head[0], head[1] = len(raw), signature
            head[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
        self._call("broadcast", head, "the handshake")
        values = head.tolist()
        leader_id = bytes(values[2 : 2 + values[0]]).decode()
        # Who differs, as a MAX over the ranks (0: nobody): every rank learns it from the
        # same collective, so they all raise, or none does; a rank that raised alone would
        # leave the others blocked in the next collective.
        wrong = torch.tensor(
            [
                self.rank if learner_id not in (None, leader_id) else 0,
                self.rank if values[1] != signature else 0,
            ],
            dtype=torch.int64,
            device=device,
        )
        self._call("all_reduce", wrong, "the handshake", op=dist.ReduceOp.MAX)
        wrong_id, wrong_layout = wrong.tolist()
        if wrong_id:
            raise ProtocolError(
                f"rank {wrong_id} of learner {leader_id} was given another learner_id than "
                "rank 0: every rank of a learner constructs its Session with the same one"
            )
        if wrong_layout:
            raise ProtocolError(
                f"rank {wrong_layout} of learner {leader_id} has another model layout or "
                "other Session settings than rank 0: every rank of a learner builds the same "
                "model and passes the same settings"
            )
        return leader_id

    # -- mirroring the leader ----------------------------------------------------------------

    def step(self, samples: int, training: TrainingLoop, layout: ModelLayout) -> None:
        """One ``step()`` of the learner over the samples of all its ranks (every rank
        calls it: their sum first, then the leader's step, mirrored)."""
        count = torch.tensor([samples], dtype=torch.int64, device=_device(layout))
        self._call("all_reduce", count, "step()")
        total = int(count.item())
        self.mirror(lambda: training.step(total), training, layout, what="step()")

    def mirror(
        self,
        call: Callable[[], object],
        training: TrainingLoop,
        layout: ModelLayout,
        *,
        what: str,
        joined: bool = False,
    ) -> None:
        """Run ``call`` on the leader (only there), then make every rank hold what
        the leader holds: the tensors of each fragment whose applied round changed (every
        tensor when ``joined``), the step and sample counts, the rounds applied. Whatever
        the leader raised is raised on every rank, after the tensors went out."""
        # The ORDER of the collectives below is the same on every rank whatever happens on
        # the leader (the header always goes, even when `call` raised; the tensors always
        # follow the header that lists them): a leader that raised before its broadcast
        # would leave its followers blocked in it until the group's timeout, and tensors
        # sent in another order than the followers expect would mismatch sizes or hang.
        n = training.fragments
        head = torch.zeros(_HEAD + 2 * n, dtype=torch.int64, device=_device(layout))
        error: BaseException | None = None
        text = b""
        if self.leader:
            before = list(training.applied)
            try:
                call()
            except BaseException as exc:  # reaches the followers, then raised here again
                error = exc
                text = f"{type(exc).__name__}: {exc}".encode()[:_TEXT_BYTES]
            changed = [joined or a != b for a, b in zip(training.applied, before, strict=True)]
            kind = next((i for i, k in enumerate(_KINDS) if isinstance(error, k)), 0)
            head[:_HEAD] = torch.tensor(
                [error is not None, kind, training.steps, training.samples, len(text)]
            )
            head[_HEAD:] = torch.tensor(list(training.applied) + changed, dtype=torch.int64)
        self._call("broadcast", head, what)
        values = head.tolist()
        applied, changed = values[_HEAD : _HEAD + n], values[_HEAD + n :]
        fragments = [f for f in range(n) if changed[f]]
        names = [name for f in fragments for name in layout.fragments[f]]
        if joined:
            names += list(layout.frozen)
        self._tensors(layout.tensor(name) for name in names)
        if not self.leader:
            training.steps, training.samples = values[_STEPS], values[_SAMPLES]
            training.applied[:] = applied
        if values[_STATUS]:
            message = torch.zeros(values[_TEXT], dtype=torch.uint8, device=head.device)
            if self.leader:
                message.copy_(torch.tensor(list(text), dtype=torch.uint8))
            self._call("broadcast", message, what)
            if error is not None:
                raise error
            kind_of = _KINDS[values[_KIND]] if values[_KIND] < len(_KINDS) else RuntimeError
            raise kind_of(
                f"{what} failed on rank 0, the leader of this learner: "
                + bytes(message.tolist()).decode(errors="replace")
            )

    def _tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from the leader into every rank's own, in place: one flat
        buffer per (device, dtype), in the order given (the same on every rank)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        with torch.no_grad():
            for members in groups.values():
                flat = torch.cat([t.detach().reshape(-1) for t in members])
                self._call("broadcast", flat, "sending parameters")
                if self.leader:
                    continue
                offset = 0
                for target in members:
                    size = target.numel()
                    target.copy_(flat[offset : offset + size].view_as(target))
                    offset += size

    def _call(self, name: str, tensor: torch.Tensor, what: str, **options: Any) -> None:
        try:
            if name == "broadcast":
                dist.broadcast(tensor, group=self.group, group_src=0)
            else:
                dist.all_reduce(tensor, group=self.group, **options)
        except Exception as exc:
            raise RanksFailed(
                f"rank {self.rank} of {self.size}: the ranks of this learner could not "
                f"{name} during {what} ({exc}); another rank died or stopped calling the "
                "Session, so this learner leaves the run: restart the whole node"
            ) from exc


def _device(layout: ModelLayout) -> torch.device:
    """Where the small collectives' tensors live: the model's (NCCL needs a GPU tensor,
    gloo takes either)."""
    name = layout.fragments[0][0]
    return layout.tensor(name).device
