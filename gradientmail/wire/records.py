"""The round protocol's records: frozen dataclasses, their JSON wire shapes (``TypedDict``),
and decoders that validate every field and raise :class:`ProtocolError` naming the key and
the problem. Which key holds which record: ``keys.py``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, NotRequired, TypedDict, TypeVar

from gradientmail.errors import ProtocolError
from gradientmail.wire.keys import (
    FORMAT_VERSION,
    ROUNDS,
    blob_sha,
    check_learner_id,
    parse_round_key,
)

_R = TypeVar("_R")

# -- wire shapes -------------------------------------------------------------------------------


class TensorSpecWire(TypedDict):
    name: str
    shape: list[int]
    dtype: str
    kind: NotRequired[str]  # omitted for "param" (written before kinds existed)


class ManifestWire(TypedDict):
    format: int
    creator: str
    algorithm: dict[str, Any]
    fragments: list[list[TensorSpecWire]]
    # Frozen parameters (added later; omitted when the model has none, and before then).
    frozen: NotRequired[list[TensorSpecWire]]
    frozen_payload: NotRequired[str]


class ContributionWire(TypedDict):
    learner: str
    samples: int
    payload: str


class ExclusionWire(TypedDict):
    learner: str
    key: str
    reason: str


class CommitWire(TypedDict):
    format: int
    round: int
    fragment: int
    base: int | None
    contributors: list[ContributionWire]
    params: str
    momentum: str | None
    closer: str
    attempt: int
    # Added later, and written only when not empty: older records and readers are unaffected.
    excluded: NotRequired[list[ExclusionWire]]


class SnapshotWire(TypedDict):
    round: int
    learner: str
    samples: int
    payload: str
    base: int


class ClaimWire(TypedDict):
    learner: str


class BeatWire(TypedDict):
    learner: str
    steps: int
    samples: int
    leaving: bool
    # Sync-point counters (added later: a beat without them reads as 0).
    sync_points: NotRequired[int]
    contributed: NotRequired[int]
    waited_s: NotRequired[float]
    skipped: NotRequired[int]


# -- records -----------------------------------------------------------------------------------


PARAM = "param"
BUFFER = "buffer"
FROZEN = "frozen"
TENSOR_KINDS = (PARAM, BUFFER, FROZEN)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model's layout, and how it travels (``kind``):

    - ``param``: a trainable parameter; synced by every round of its fragment through the
      outer optimizer (the default, and the only kind before kinds existed);
    - ``buffer``: a floating-point buffer (BatchNorm's running statistics); synced by every
      round of its fragment as the contributions' plain sample-weighted average, or the
      closer's copy (``DiLoCo(buffers=...)``): no outer step, no momentum;
    - ``frozen``: a parameter with ``requires_grad=False``; sent once, with the manifest
      (:attr:`Manifest.frozen`), never in a round.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str = PARAM

    def noun(self) -> str:
        return "buffer" if self.kind == BUFFER else "parameter"

    def describe(self) -> str:
        suffix = "" if self.kind == PARAM else f" ({self.kind})"
        return f"{self.dtype}{list(self.shape)}{suffix}"

    def to_wire(self) -> TensorSpecWire:
        wire: TensorSpecWire = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.kind != PARAM:  # omitted for the default: older manifests read unchanged
            wire["kind"] = self.kind
        return wire


@dataclass(frozen=True)
class Manifest:
    """The run: its algorithm and the model's layout.

    ``fragments``: what each fragment's rounds carry (kinds ``param`` and ``buffer``).
    ``frozen``: the parameters with ``requires_grad=False`` (kind ``frozen``), never in a
    round; ``frozen_payload`` names their values, stored by the creator before this record
    (every node loads them at join, ``align`` too), or is ``None`` when the creator did not
    store them (each node then keeps its own). Both are left out of the wire when empty, so
    a manifest without frozen parameters is what earlier releases wrote.
    """

    creator: str
    algorithm: Mapping[str, Any]
    fragments: tuple[tuple[TensorSpec, ...], ...]
    format: int = FORMAT_VERSION
    frozen: tuple[TensorSpec, ...] = ()
    frozen_payload: str | None = None

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def to_wire(self) -> ManifestWire:
        wire: ManifestWire = {
            "format": self.format,
            "creator": self.creator,
            "algorithm": dict(self.algorithm),
            "fragments": [[t.to_wire() for t in fragment] for fragment in self.fragments],
        }
        if self.frozen:
            wire["frozen"] = [t.to_wire() for t in self.frozen]
        if self.frozen_payload is not None:
            wire["frozen_payload"] = self.frozen_payload
        return wire

    def differences(self, other: Manifest) -> list[str]:
        """Human-readable differences in algorithm settings and model layout (each tensor's
        kind included; ``frozen_payload`` is not compared: the values come from the run)."""
        found: list[str] = []
        for name in sorted(set(self.algorithm) | set(other.algorithm)):
            mine, theirs = self.algorithm.get(name), other.algorithm.get(name)
            if mine != theirs:
                found.append(f"algorithm {name}: run has {mine!r}, this node has {theirs!r}")
        if self.num_fragments != other.num_fragments:
            found.append(
                f"fragments: run has {self.num_fragments}, this node has {other.num_fragments}"
            )
        mine_specs = {t.name: t for f in (*self.fragments, self.frozen) for t in f}
        their_specs = {t.name: t for f in (*other.fragments, other.frozen) for t in f}
        for name in sorted(set(mine_specs) - set(their_specs))[:5]:
            what = mine_specs[name].noun()
            found.append(f"{what} {name} is in the run's model but not in this node's")
        for name in sorted(set(their_specs) - set(mine_specs))[:5]:
            what = their_specs[name].noun()
            found.append(f"{what} {name} is in this node's model but not in the run's")
        for name in sorted(set(mine_specs) & set(their_specs)):
            if mine_specs[name] != their_specs[name] and len(found) < 10:
                found.append(
                    f"{mine_specs[name].noun()} {name}: run has {mine_specs[name].describe()}, "
                    f"this node has {their_specs[name].describe()}"
                )
        if not found and self.fragments != other.fragments:
            found.append("parameters are split into fragments differently")
        return found


@dataclass(frozen=True)
class Contribution:
    learner: str
    samples: int
    payload: str


@dataclass(frozen=True)
class Exclusion:
    """A contribution the closer listed but could not use: ``key`` is its snapshot record,
    ``learner`` the key's last segment (not necessarily a valid id), ``reason`` why (a
    corrupt or missing payload, a malformed record). Informational: it is not combined."""

    learner: str
    key: str
    reason: str


@dataclass(frozen=True)
class Commit:
    """Round ``round``'s result for ``fragment``: new parameters and outer momentum.

    Recomputable from this record and the commit of round ``base`` (``round - P``): only
    ``contributors`` are combined; ``excluded`` lists snapshots of the round the closer
    could not load or verify, and why. Rounds ``< P`` are the initial commits: ``base`` is
    ``None`` and there are no contributors.
    """

    round: int
    fragment: int
    base: int | None
    contributors: tuple[Contribution, ...]
    params: str
    momentum: str | None
    closer: str
    attempt: int = 0
    format: int = FORMAT_VERSION
    excluded: tuple[Exclusion, ...] = ()

    @property
    def samples(self) -> int:
        return sum(c.samples for c in self.contributors)

    def to_wire(self) -> CommitWire:
        wire: CommitWire = {
            "format": self.format,
            "round": self.round,
            "fragment": self.fragment,
            "base": self.base,
            "contributors": [asdict(c) for c in self.contributors],  # type: ignore[misc]
            "params": self.params,
            "momentum": self.momentum,
            "closer": self.closer,
            "attempt": self.attempt,
        }
        if self.excluded:
            wire["excluded"] = [
                {"learner": x.learner, "key": x.key, "reason": x.reason} for x in self.excluded
            ]
        return wire


@dataclass(frozen=True)
class Snapshot:
    round: int
    learner: str
    samples: int
    payload: str
    base: int

    def to_wire(self) -> SnapshotWire:
        return {
            "round": self.round,
            "learner": self.learner,
            "samples": self.samples,
            "payload": self.payload,
            "base": self.base,
        }


@dataclass(frozen=True)
class Claim:
    learner: str

    def to_wire(self) -> ClaimWire:
        return {"learner": self.learner}


@dataclass(frozen=True)
class Beat:
    """A heartbeat, with the learner's counters so far (``gradientmail status`` shows them).

    ``sync_points``: sync points its training reached; ``contributed``: contributions it
    made at them; ``waited_s``: seconds ``step()`` waited at them; ``skipped``: sync points
    it let pass without contributing. Beats written before these existed read as 0.
    """

    learner: str
    steps: int = 0
    samples: int = 0
    leaving: bool = False
    sync_points: int = 0
    contributed: int = 0
    waited_s: float = 0.0
    skipped: int = 0

    def to_wire(self) -> BeatWire:
        return {
            "learner": self.learner,
            "steps": self.steps,
            "samples": self.samples,
            "leaving": self.leaving,
            "sync_points": self.sync_points,
            "contributed": self.contributed,
            "waited_s": self.waited_s,
            "skipped": self.skipped,
        }


@dataclass(frozen=True)
class CreatorClaim:
    learner: str
    format: int = field(default=FORMAT_VERSION)


# -- JSON codec --------------------------------------------------------------------------------


def encode(record: Any) -> bytes:
    """Canonical JSON bytes of a record (sorted keys, no spaces)."""
    wire = record.to_wire() if hasattr(record, "to_wire") else asdict(record)
    return json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()


class _Reader:
    """Typed field access on a decoded JSON object, raising ProtocolError with the key."""

    def __init__(self, key: str, data: bytes | None) -> None:
        self.key = key
        if data is None:
            raise ProtocolError(f"{key}: the object is missing")
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
    return Manifest(
        reader.text("creator"),
        reader.mapping("algorithm"),
        tuple(fragments),
        frozen=frozen,
        frozen_payload=frozen_payload,
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
            Contribution(check_learner_id(sub.text("learner")), sub.integer("samples", 1), payload)
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
    )
    if key.startswith(ROUNDS) and parse_round_key(key) != commit.round:
        raise ProtocolError(f"{key}: the record says round {commit.round}")
    return commit


@_names_key
def decode_snapshot(key: str, data: bytes | None) -> Snapshot:
    reader = _Reader(key, data)
    payload = reader.text("payload")
    blob_sha(payload)
    return Snapshot(
        round=reader.integer("round"),
        learner=check_learner_id(reader.text("learner")),
        samples=reader.integer("samples", 1),
        payload=payload,
        base=reader.integer("base"),
    )


@_names_key
def decode_claim(key: str, data: bytes | None) -> Claim:
    return Claim(_Reader(key, data).text("learner"))


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
    )
