"""An optimizer's ``state_dict()`` as JSON and named tensors, and back, exactly (no pickle).

``torch.save`` would pickle the state, and bytes read back from a shared bucket must never
run code. So the state is split: its tensors travel as a safetensors payload (the payload
codec's, content-addressed and verified like every other), everything else as JSON in the
learner's resume record (``wire/records.py``: :class:`ResumeState`).

Restoring must give back what ``state_dict()`` gave, value for value and type for type
(``load_state_dict`` then gives the optimizer the state it had, and its next step the
same parameters, bit for bit). Plain JSON would lose distinctions that matter to it: a
tuple (Adam's ``betas``) would come back a list, an ``int`` key of ``state`` a string, a
``nan`` would not be JSON at all. So the JSON is *tagged*: ``None``, booleans, integers,
finite floats, strings and lists are themselves; everything else is a one-key object

- ``{"$tensor": name}``: a tensor, stored in the payload as ``name`` (its path in the state,
  ``state.0.exp_avg``: readable, and stable from one save to the next);
- ``{"$tuple": [...]}``; ``{"$dict": [[key, value], ...]}`` (insertion order and key types
  kept; keys are integers or strings); ``{"$float": "nan" | "inf" | "-inf"}``.

A value of any other type (a callable, a dtype) cannot be stored: :func:`encode_state`
raises ``TypeError`` naming where it is. Decoding checks every tag and raises
:class:`ProtocolError` naming the record's key for anything else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gradientmail.errors import ProtocolError
from gradientmail.ledger import LEDGER, SNAPSHOTS

__all__ = ["RESUME_ID", "Groups", "decode_state", "describe", "differences", "encode_state"]

RESUME_ID = "resume.key"
"""A uint8 tensor in every resume payload: the UTF-8 bytes of its record's key. It makes
each save's payload bytes its own (content addressing would otherwise let two learners'
identical states, an empty one say, share one blob, and one learner's sweep delete what
the other's newest record names), and lets a restore check that the payload it read is
its record's."""

Groups = tuple[tuple[tuple[int, ...], ...], ...]
"""The shapes of each parameter group's parameters, in order."""

_TENSOR, _TUPLE, _DICT, _FLOAT = "$tensor", "$tuple", "$dict", "$float"


def encode_state(
    state: Mapping[str, Any], *, copy: bool = True
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``optimizer.state_dict()`` -> (tagged JSON, tensors by name). With ``copy`` every
    tensor is copied to host memory (charged to ``snapshots`` in the ledger until freed):
    the optimizer's own tensors change at its next step, and the copy is uploaded later,
    on another thread. ``copy=False`` only checks that the state can be stored."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {_FLOAT: repr(value)}
        if isinstance(value, torch.Tensor):
            if path in tensors:
                raise TypeError(f"optimizer state: two tensors would be stored as {path!r}")
            tensors[path] = _host_copy(value) if copy else value
            return {_TENSOR: path}
        if isinstance(value, list | tuple):
            items = [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
            return {_TUPLE: items} if isinstance(value, tuple) else items
        if isinstance(value, dict):
            pairs = []
            for k, v in value.items():
                if not isinstance(k, int | str) or isinstance(k, bool):
                    raise TypeError(
                        f"optimizer state: {path or 'the state'} has a key {k!r} of type "
                        f"{type(k).__name__}; only int and str keys can be stored"
                    )
                pairs.append([k, walk(v, f"{path}.{k}" if path else str(k))])
            return {_DICT: pairs}
        raise TypeError(
            f"optimizer state: {path or 'the state'} is a {type(value).__name__}, which cannot "
            "be stored without pickle (supported: tensors, numbers, strings, None, and "
            "lists, tuples and dicts of them)"
        )

    return walk(dict(state), ""), tensors


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.detach().to("cpu", copy=True)
    if out.numel():
        LEDGER.track(SNAPSHOTS, out.untyped_storage(), out.untyped_storage().nbytes())
    return out


def decode_state(key: str, tagged: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Tagged JSON and the payload's tensors -> the ``state_dict`` :func:`encode_state` was
    given. Each tensor is copied into fresh, writable memory (the payload's are read-only
    views of the bytes received, and the optimizer updates its state in place). Every
    tensor of the payload must be named exactly once (besides :data:`RESUME_ID`)."""
    used: set[str] = set()

    def walk(value: Any) -> Any:
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict) or len(value) != 1:
            raise ProtocolError(f"{key}: the optimizer state holds an untagged {value!r:.80}")
        ((tag, inner),) = value.items()
        if tag == _TENSOR and isinstance(inner, str):
            if inner not in tensors or inner == RESUME_ID or inner in used:
                raise ProtocolError(f"{key}: tensor {inner!r} is missing from the payload")
            used.add(inner)
            return tensors[inner].clone()
        if tag == _TUPLE and isinstance(inner, list):
            return tuple(walk(v) for v in inner)
        if tag == _FLOAT and inner in ("nan", "inf", "-inf"):
            return float(inner)
        if tag == _DICT and isinstance(inner, list):
            out: dict[int | str, Any] = {}
            for pair in inner:
                if (
                    not isinstance(pair, list)
                    or len(pair) != 2
                    or not isinstance(pair[0], int | str)
                    or isinstance(pair[0], bool)
                ):
                    raise ProtocolError(f"{key}: a bad dict entry {pair!r:.80} in the state")
                out[pair[0]] = walk(pair[1])
            return out
        raise ProtocolError(f"{key}: unknown tag {tag!r} in the optimizer state")

    state = walk(tagged)
    unused = set(tensors) - used - {RESUME_ID}
    if unused:
        raise ProtocolError(f"{key}: the payload holds tensors the state does not name: {unused}")
    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        raise ProtocolError(f"{key}: not an optimizer state_dict (state and param_groups)")
    return state


def describe(optimizer: torch.optim.Optimizer) -> tuple[str, Groups]:
    """The optimizer's class (``module.QualName``) and the shapes of each parameter
    group's parameters: what a saved state must match to be loaded."""
    kind = type(optimizer)
    groups = tuple(
        tuple(tuple(param.shape) for param in group["params"]) for group in optimizer.param_groups
    )
    return f"{kind.__module__}.{kind.__qualname__}", groups


def differences(
    saved_class: str,
    saved_groups: Groups,
    optimizer: torch.optim.Optimizer,
) -> list[str]:
    """How ``optimizer`` differs from the one a state was saved from (empty: it matches)."""
    kind, groups = describe(optimizer)
    found = []
    if kind != saved_class:
        found.append(f"the state is of {saved_class}, this optimizer is a {kind}")
    if len(groups) != len(saved_groups):
        found.append(
            f"the state has {len(saved_groups)} parameter group(s), this optimizer {len(groups)}"
        )
    for index, (saved, mine) in enumerate(zip(saved_groups, groups, strict=False)):
        if len(saved) != len(mine):
            found.append(
                f"parameter group {index} holds {len(saved)} parameters in the state, "
                f"{len(mine)} in this optimizer"
            )
            continue
        for position, (a, b) in enumerate(zip(saved, mine, strict=True)):
            if a != b:
                found.append(
                    f"parameter {position} of group {index} is {list(a)} in the state, "
                    f"{list(b)} in this optimizer"
                )
                break
    return found
