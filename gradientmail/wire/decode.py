"""Decoding records: JSON bytes -> the frozen records of ``records.py``, every field
validated; a problem raises :class:`ProtocolError` naming the key and what is wrong
(truncated, not JSON, a missing or mistyped field, a newer format)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, TypeVar

from gradientmail.errors import ObjectMissing, ProtocolError
from gradientmail.wire.keys import (
    FORMAT_VERSION,
    GROUP_ROUNDS,
    ROUNDS,
    blob_sha,
    check_group,
    check_learner_id,
    parse_group_round_key,
    parse_round_key,
)
from gradientmail.wire.records import (
    BUFFER,
    FROZEN,
    OUTER_DTYPE,
    PARAM,
    Beat,
    Claim,
    Commit,
    Contribution,
    CreatorClaim,
    Exclusion,
    Manifest,
    RoundFailure,
    Snapshot,
    TensorSpec,
    Totals,
)

_R = TypeVar("_R")


class _Reader:
    """Typed field access on a decoded JSON object, raising ProtocolError with the key."""

    def __init__(self, key: str, data: bytes | None) -> None:
        self.key = key
        if data is None:
            raise ObjectMissing(f"{key}: the object is missing")
        try:
            value = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(
                f"{key}: not valid JSON ({exc}); truncated or not written by GradientMail"
            ) from exc
        if not isinstance(value, dict):
            raise ProtocolError(f"{key}: expected a JSON object, got {type(value).__name__}")
        self.obj: dict[str, Any] = value

    @classmethod
    def of(cls, key: str, obj: object) -> _Reader:
        reader = cls.__new__(cls)
        reader.key = key
        if not isinstance(obj, dict):
            raise ProtocolError(f"{key}: expected a JSON object, got {obj!r}")
        reader.obj = obj
        return reader

    def _get(self, name: str, kinds: tuple[type, ...], optional: bool = False) -> Any:
        if name not in self.obj:
            if optional:
                return None
            raise ProtocolError(f"{self.key}: field {name!r} is missing")
        value = self.obj[name]
        if value is None and optional:
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ProtocolError(f"{self.key}: field {name!r} has the wrong type: {value!r}")
        return value

    def text(self, name: str) -> str:
        value: str = self._get(name, (str,))
        return value

    def opt_text(self, name: str) -> str | None:
        value: str | None = self._get(name, (str,), optional=True)
        return value

    def integer(self, name: str, minimum: int = 0) -> int:
        value: int = self._get(name, (int,))
        if value < minimum:
            raise ProtocolError(f"{self.key}: field {name!r} is {value}, below {minimum}")
        return value

    def opt_integer(self, name: str) -> int | None:
        value: int | None = self._get(name, (int,), optional=True)
        return value

    def flag(self, name: str) -> bool:
        value: bool = self._get(name, (bool,))
        return value

    def items(self, name: str) -> list[Any]:
        value: list[Any] = self._get(name, (list,))
        return value

    def mapping(self, name: str) -> dict[str, Any]:
        value: dict[str, Any] = self._get(name, (dict,))
        return value

    def format(self) -> int:
        version = self.integer("format")
        if version != FORMAT_VERSION:
            raise ProtocolError(
                f"{self.key}: format version {version}; this GradientMail speaks "
                f"{FORMAT_VERSION}. Upgrade every node to the same release."
            )
        return version


def _names_key(decoder: Callable[[str, bytes | None], _R]) -> Callable[[str, bytes | None], _R]:
    """Re-raise a decoder's complaint as a ProtocolError that names the record's key."""

    @functools.wraps(decoder)
    def decode(key: str, data: bytes | None) -> _R:
        try:
            return decoder(key, data)
        except ProtocolError as exc:
            if str(exc).startswith(key):
                raise
            raise ProtocolError(f"{key}: {exc}") from exc
        except ValueError as exc:
            raise ProtocolError(f"{key}: {exc}") from exc

    return decode


@_names_key
def decode_creator(key: str, data: bytes | None) -> CreatorClaim:
    reader = _Reader(key, data)
    return CreatorClaim(check_learner_id(reader.text("learner")), reader.format())


@_names_key
def decode_manifest(key: str, data: bytes | None) -> Manifest:
    reader = _Reader(key, data)
    reader.format()
    fragments = []
    for index, raw in enumerate(reader.items("fragments")):
        if not isinstance(raw, list):
            raise ProtocolError(f"{key}: fragment {index} is not a list")
        specs = tuple(_spec(key, f"fragment {index}", item, (PARAM, BUFFER)) for item in raw)
        fragments.append(specs)
    if not fragments:
        raise ProtocolError(f"{key}: the manifest lists no fragments")
    frozen: tuple[TensorSpec, ...] = ()
    if "frozen" in reader.obj:
        frozen = tuple(_spec(key, "frozen", item, (FROZEN,)) for item in reader.items("frozen"))
    frozen_payload = reader.opt_text("frozen_payload")
    if frozen_payload is not None:
        blob_sha(frozen_payload)
    listed = {spec.name for specs in (*fragments, frozen) for spec in specs}
    aliases = reader.mapping("aliases") if "aliases" in reader.obj else {}
    for alias, name in aliases.items():
        if not isinstance(name, str) or name not in listed or alias in listed:
            raise ProtocolError(
                f"{key}: alias {alias!r} -> {name!r}: an alias must name a tensor the manifest "
                "lists, under a name it does not list"
            )
    manifest = Manifest(
        reader.text("creator"),
        reader.mapping("algorithm"),
        tuple(fragments),
        frozen=frozen,
        frozen_payload=frozen_payload,
        aliases=aliases,
    )
    _check_outer_dtype(key, reader.opt_text("outer_dtype"), manifest)
    return manifest


def _check_outer_dtype(key: str, outer: str | None, manifest: Manifest) -> None:
    """The commits of a run are readable here: stored in :data:`OUTER_DTYPE`, which the
    manifest names whenever a model's tensor has another dtype (``Manifest``)."""
    if outer is not None and outer != OUTER_DTYPE:
        raise ProtocolError(
            f"{key}: commits store {outer}; this GradientMail keeps the outer state in "
            f"{OUTER_DTYPE}. Upgrade every node to the same release."
        )
    if outer is None and manifest.stores_other_dtypes:
        found = {spec.dtype for fragment in manifest.fragments for spec in fragment}
        raise ProtocolError(
            f"{key}: this run was created by a GradientMail release that stored commits in "
            f"the model's dtypes ({', '.join(sorted(found - {OUTER_DTYPE}))}); this release "
            f"keeps them in {OUTER_DTYPE} and cannot read that run. Finish it with the "
            "release that created it, or start a new run."
        )


def _spec(key: str, where: str, item: object, kinds: tuple[str, ...]) -> TensorSpec:
    """One tensor of a manifest; its ``kind`` (absent: ``param``) must be one of ``kinds``."""
    sub = _Reader.of(f"{key} {where}", item)
    shape = sub.items("shape")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ProtocolError(f"{key}: bad shape {shape!r}")
    kind = sub.text("kind") if "kind" in sub.obj else PARAM
    if kind not in kinds:
        raise ProtocolError(
            f"{key}: {where} lists {sub.obj.get('name')!r} of kind {kind!r}; expected "
            + " or ".join(repr(k) for k in kinds)
        )
    return TensorSpec(sub.text("name"), tuple(shape), sub.text("dtype"), kind)


@_names_key
def decode_commit(key: str, data: bytes | None) -> Commit:
    reader = _Reader(key, data)
    reader.format()
    contributors = []
    for item in reader.items("contributors"):
        sub = _Reader.of(f"{key} contributor", item)
        payload = sub.text("payload")
        blob_sha(payload)
        contributors.append(
            Contribution(
                check_learner_id(sub.text("learner")),
                sub.integer("samples", 1),
                payload,
                _grid(sub) if "grid" in sub.obj else None,
            )
        )
    params = reader.text("params")
    blob_sha(params)
    momentum = reader.opt_text("momentum")
    if momentum is not None:
        blob_sha(momentum)
    excluded = []
    for item in reader.items("excluded") if "excluded" in reader.obj else ():
        sub = _Reader.of(f"{key} exclusion", item)
        excluded.append(Exclusion(sub.text("learner"), sub.text("key"), sub.text("reason")))
    totals = None
    if "totals" in reader.obj:  # added later: absent from older records
        sub = _Reader.of(f"{key} totals", reader.obj["totals"])
        totals = Totals(sub.integer("rounds"), sub.integer("samples"))
    commit = Commit(
        round=reader.integer("round"),
        fragment=reader.integer("fragment"),
        base=reader.opt_integer("base"),
        contributors=tuple(contributors),
        params=params,
        momentum=momentum,
        closer=reader.text("closer"),
        attempt=reader.integer("attempt"),
        excluded=tuple(excluded),
        totals=totals,
        stored=reader.flag("stored") if "stored" in reader.obj else True,
        group=check_group(reader.text("group")) if "group" in reader.obj else None,
    )
    if not commit.stored and commit.base is None:
        raise ProtocolError(f"{key}: an initial commit must store its parameters")
    if key.startswith(ROUNDS) and parse_round_key(key) != commit.round:
        raise ProtocolError(f"{key}: the record says round {commit.round}")
    if key.startswith(GROUP_ROUNDS) and parse_group_round_key(key) != (commit.round, commit.group):
        raise ProtocolError(
            f"{key}: the record says group {commit.group!r} of round {commit.round}"
        )
    return commit


def _grid(reader: _Reader) -> tuple[int, ...]:
    coords = reader.items("grid")
    if not 1 <= len(coords) <= 8 or not all(type(c) is int and 0 <= c < 1000 for c in coords):
        raise ProtocolError(f"{reader.key}: grid must be 1 to 8 coordinates in 0..999")
    return tuple(coords)


@_names_key
def decode_snapshot(key: str, data: bytes | None) -> Snapshot:
    reader = _Reader(key, data)
    payload = reader.text("payload")
    blob_sha(payload)
    grid = _grid(reader) if "grid" in reader.obj else None  # a Moshpit group snapshot's
    return Snapshot(
        round=reader.integer("round"),
        learner=check_learner_id(reader.text("learner")),
        samples=reader.integer("samples", 1),
        payload=payload,
        base=reader.integer("base"),
        grid=grid,
    )


@_names_key
def decode_claim(key: str, data: bytes | None) -> Claim:
    return Claim(_Reader(key, data).text("learner"))


@_names_key
def decode_failure(key: str, data: bytes | None) -> RoundFailure:
    reader = _Reader(key, data)
    reader.format()
    return RoundFailure(
        reader.integer("round"),
        check_learner_id(reader.text("closer")),
        reader.integer("attempt"),
        reader.text("reason"),
    )


def _beat_count(reader: _Reader, name: str) -> int:
    """An optional counter of a beat: absent (an older writer) reads as 0."""
    return 0 if name not in reader.obj else reader.integer(name)


@_names_key
def decode_beat(key: str, data: bytes | None) -> Beat:
    reader = _Reader(key, data)
    waited = reader._get("waited_s", (int, float), optional=True)
    if waited is not None and not 0 <= waited < float("inf"):
        raise ProtocolError(f"{key}: field 'waited_s' is {waited!r}, not a number of seconds")
    return Beat(
        learner=reader.text("learner"),
        steps=reader.integer("steps"),
        samples=reader.integer("samples"),
        leaving=reader.flag("leaving"),
        sync_points=_beat_count(reader, "sync_points"),
        contributed=_beat_count(reader, "contributed"),
        waited_s=0.0 if waited is None else float(waited),
        skipped=_beat_count(reader, "skipped"),
        bytes_up=_beat_count(reader, "bytes_up"),
        bytes_down=_beat_count(reader, "bytes_down"),
    )
