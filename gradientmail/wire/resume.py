"""A learner's resume save (``resume/{learner}/{save}``): the record, its JSON shape and its
decoder (no I/O, no torch). ``Session(optimizer=...)`` writes one every few sync points and
reads the newest when it restarts (``session/_resume.py``); the tensors it names are a
payload like any other, the optimizer state's structure is tagged JSON in the record
(``session/_optstate.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from gradientmail.errors import ProtocolError
from gradientmail.wire.decode import _Reader
from gradientmail.wire.keys import FORMAT_VERSION, blob_sha, check_learner_id, parse_resume_key

__all__ = ["ResumeCountersWire", "ResumeState", "ResumeStateWire", "decode_resume"]


class ResumeCountersWire(TypedDict):
    sync_points: int
    contributed: int
    skipped: int
    waited_s: float


class ResumeStateWire(TypedDict):
    format: int
    learner: str
    save: int
    step: int
    samples: int
    rounds: list[int]
    counters: ResumeCountersWire
    optimizer: str
    groups: list[list[list[int]]]
    state: Any
    payload: str
    nbytes: int


@dataclass(frozen=True)
class ResumeState:
    """What a learner resumes from when it restarts (``Session(optimizer=...)``): its
    optimizer's state and its counters, as they were at one of its sync points (or at
    ``close()``). Written by the learner alone, under ``resume/{learner}/{save}``.

    ``optimizer``: the optimizer's class (``module.QualName``); ``groups``: the shapes of
    each parameter group's parameters, in order. Both are compared with the restarted
    learner's optimizer before anything is loaded, so a different optimizer or grouping is
    named, never loaded in part. ``state``: ``optimizer.state_dict()`` as tagged JSON
    (``session/_resume.py``), every tensor in it replaced by its name in ``payload``
    (content-addressed safetensors bytes, ``nbytes`` long). ``step`` and ``samples``: the
    learner's counts; ``rounds``: the commit of each fragment it had applied;
    ``sync_points``, ``contributed``, ``skipped``, ``waited_s``: the counters its beats carry,
    of the sync points settled by then.
    """

    learner: str
    save: int
    step: int
    samples: int
    rounds: tuple[int, ...]
    optimizer: str
    groups: tuple[tuple[tuple[int, ...], ...], ...]
    state: Any
    payload: str
    nbytes: int
    sync_points: int = 0
    contributed: int = 0
    skipped: int = 0
    waited_s: float = 0.0
    format: int = FORMAT_VERSION

    def to_wire(self) -> ResumeStateWire:
        return {
            "format": self.format,
            "learner": self.learner,
            "save": self.save,
            "step": self.step,
            "samples": self.samples,
            "rounds": list(self.rounds),
            "counters": {
                "sync_points": self.sync_points,
                "contributed": self.contributed,
                "skipped": self.skipped,
                "waited_s": self.waited_s,
            },
            "optimizer": self.optimizer,
            "groups": [[list(shape) for shape in group] for group in self.groups],
            "state": self.state,
            "payload": self.payload,
            "nbytes": self.nbytes,
        }


def _ints(key: str, value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise ProtocolError(f"{key}: {what} is {value!r}, not a list of counts")
    return tuple(value)


def decode_resume(key: str, data: bytes | None) -> ResumeState:
    """Bytes of ``resume/{learner}/{save}`` -> :class:`ResumeState`, every field checked
    against its key (learner, save number) and its type; :class:`ProtocolError` naming the
    key otherwise. The tagged ``state`` is checked where it is turned back into tensors
    (``session/_resume.py``): this module has no torch."""
    learner, save = parse_resume_key(key)
    record = _Reader(key, data)
    record.format()
    if record.obj.get("learner") != learner or record.obj.get("save") != save:
        raise ProtocolError(
            f"{key}: the record says learner {record.obj.get('learner')!r}, "
            f"save {record.obj.get('save')!r}"
        )
    check_learner_id(learner)
    counters = _Reader.of(key, record.mapping("counters"))
    waited = counters._get("waited_s", (int, float))
    if not 0 <= waited < float("inf"):
        raise ProtocolError(f"{key}: counter 'waited_s' is {waited!r}, not a number of seconds")
    payload = record.text("payload")
    try:
        blob_sha(payload)
    except ProtocolError as exc:
        raise ProtocolError(f"{key}: {exc}") from exc
    groups = record.items("groups")
    if not all(isinstance(g, list) for g in groups):
        raise ProtocolError(f"{key}: field 'groups' is not a list of lists")
    return ResumeState(
        learner=learner,
        save=save,
        step=record.integer("step"),
        samples=record.integer("samples"),
        rounds=_ints(key, record.obj.get("rounds"), "field 'rounds'"),
        optimizer=record.text("optimizer"),
        groups=tuple(
            tuple(_ints(key, shape, f"a shape of group {i}") for shape in group)
            for i, group in enumerate(groups)
        ),
        state=record.obj.get("state"),
        payload=payload,
        nbytes=record.integer("nbytes"),
        sync_points=counters.integer("sync_points"),
        contributed=counters.integer("contributed"),
        skipped=counters.integer("skipped"),
        waited_s=float(waited),
    )
