"""A learner's resume save (``resume/{learner}/{save}``): the record, its JSON shape and its
decoder (no I/O, no torch). ``Session(optimizer=...)`` writes one every few sync points and
reads the newest when it restarts (``session/_resume.py``); the tensors it names are a
payload like any other, the optimizer state's structure is tagged JSON in the record
(``session/_optstate.py``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from gradientmail.errors import ProtocolError
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


def _count(key: str, obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ProtocolError(f"{key}: field {name!r} is {value!r}, not a count")
    return value


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
    if data is None:
        raise ProtocolError(f"{key}: the object is missing")
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(
            f"{key}: not valid JSON ({exc}); truncated or not written by GradientMail"
        ) from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"{key}: expected a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT_VERSION:
        raise ProtocolError(
            f"{key}: format version {obj.get('format')!r}; this GradientMail speaks "
            f"{FORMAT_VERSION}"
        )
    if obj.get("learner") != learner or obj.get("save") != save:
        raise ProtocolError(
            f"{key}: the record says learner {obj.get('learner')!r}, save {obj.get('save')!r}"
        )
    check_learner_id(learner)
    counters = obj.get("counters")
    if not isinstance(counters, dict):
        raise ProtocolError(f"{key}: field 'counters' is {counters!r}, not an object")
    waited = counters.get("waited_s")
    if (
        not isinstance(waited, int | float)
        or isinstance(waited, bool)
        or not 0 <= waited < float("inf")
    ):
        raise ProtocolError(f"{key}: counter 'waited_s' is {waited!r}, not a number of seconds")
    optimizer, payload = obj.get("optimizer"), obj.get("payload")
    if not isinstance(optimizer, str) or not isinstance(payload, str):
        raise ProtocolError(f"{key}: fields 'optimizer' and 'payload' must be strings")
    try:
        blob_sha(payload)
    except ProtocolError as exc:
        raise ProtocolError(f"{key}: {exc}") from exc
    groups = obj.get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise ProtocolError(f"{key}: field 'groups' is not a list of lists")
    return ResumeState(
        learner=learner,
        save=save,
        step=_count(key, obj, "step"),
        samples=_count(key, obj, "samples"),
        rounds=_ints(key, obj.get("rounds"), "field 'rounds'"),
        optimizer=optimizer,
        groups=tuple(
            tuple(_ints(key, shape, f"a shape of group {i}") for shape in group)
            for i, group in enumerate(groups)
        ),
        state=obj.get("state"),
        payload=payload,
        nbytes=_count(key, obj, "nbytes"),
        sync_points=_count(key, counters, "sync_points"),
        contributed=_count(key, counters, "contributed"),
        skipped=_count(key, counters, "skipped"),
        waited_s=float(waited),
    )
