"""The round protocol's records: frozen dataclasses, their JSON wire shapes (``TypedDict``),
and decoders that validate every field and raise :class:`ProtocolError` naming the key and
the problem. Which key holds which record: ``keys.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, NotRequired, TypedDict, TypeVar

from gradientmail.wire.keys import (
    FORMAT_VERSION,
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
    # The dtype run-wide commits store every fragment tensor in (added with float32 outer
    # state; written when the model has a tensor in another dtype: see Manifest).
    outer_dtype: NotRequired[str]
    # Tied names (added later; omitted when the model ties nothing, and before then).
    aliases: NotRequired[dict[str, str]]


class ContributionWire(TypedDict):
    learner: str
    samples: int
    payload: str
    # A Moshpit group member's grid index in that round (absent otherwise).
    grid: NotRequired[list[int]]


class ExclusionWire(TypedDict):
    learner: str
    key: str
    reason: str


class TotalsWire(TypedDict):
    rounds: int
    samples: int


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
    # Added later, and written only when known: the fragment's running totals (see Totals).
    totals: NotRequired[TotalsWire]
    # Added later, and written only when false: the parameters are not stored (see Commit).
    stored: NotRequired[bool]
    # A Moshpit group round's commit: the group's name (see Commit.group).
    group: NotRequired[str]


class SnapshotWire(TypedDict):
    round: int
    learner: str
    samples: int
    payload: str
    base: int
    # A Moshpit group snapshot: the learner's grid index in that round.
    grid: NotRequired[list[int]]


class ClaimWire(TypedDict):
    learner: str


class RoundFailureWire(TypedDict):
    format: int
    round: int
    closer: str
    attempt: int
    reason: str


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
    # Bytes this learner moved to and from the mailbox, every kind (added later).
    bytes_up: NotRequired[int]
    bytes_down: NotRequired[int]


# -- records -----------------------------------------------------------------------------------


PARAM = "param"
BUFFER = "buffer"
FROZEN = "frozen"
TENSOR_KINDS = (PARAM, BUFFER, FROZEN)

OUTER_DTYPE = "torch.float32"
"""The dtype of the outer state, whatever the model's: a run-wide commit (``rounds/{r}``)
stores its fragment's global parameters, buffers and outer momentum in it (a bfloat16
global would round small outer steps away). What a learner loads into a parameter of
another dtype is the float32 global rounded by ``Tensor.to`` (round to nearest, ties to
even). Contributions (snapshots) and Moshpit group commits, averages of what learners
hold, stay in the model's dtypes."""


def outer_specs(specs: Sequence[TensorSpec]) -> tuple[TensorSpec, ...]:
    """``specs`` as a run-wide commit stores them: each in :data:`OUTER_DTYPE`. The one
    rule every reader of a commit's payload (closer, syncer, verify, align, chains) uses."""
    return tuple(replace(spec, dtype=OUTER_DTYPE) for spec in specs)


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

    The specs give the model's dtypes; run-wide commits store every fragment tensor in
    :data:`OUTER_DTYPE` (:func:`outer_specs`). The wire says so (``outer_dtype``) whenever
    that differs from a tensor's own dtype: releases before float32 outer state stored
    commits in the model's dtypes, and their manifests lack the field, so such a run is
    refused by name when read (``decode_manifest``) rather than misread. A float32 model's
    commits are the same bytes under either rule, so its manifest leaves the field out
    and reads as before.

    ``aliases``: ``{name: listed name}`` for each further name under which the model's
    ``state_dict`` holds a listed tensor (tied weights: GPT-2's ``lm_head.weight`` is its
    ``transformer.wte.weight``). A tied tensor travels once, under its first name; the
    aliases let ``gradientmail align --out`` write every name ``state_dict`` has. Left out
    of the wire when empty (and absent from runs created before it existed); not compared
    by :meth:`differences`: a model tied differently already lists different tensors.
    """

    creator: str
    algorithm: Mapping[str, Any]
    fragments: tuple[tuple[TensorSpec, ...], ...]
    format: int = FORMAT_VERSION
    frozen: tuple[TensorSpec, ...] = ()
    frozen_payload: str | None = None
    aliases: Mapping[str, str] = field(default_factory=dict)

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
        if self.aliases:
            wire["aliases"] = dict(sorted(self.aliases.items()))
        if self.stores_other_dtypes:
            wire["outer_dtype"] = OUTER_DTYPE
        return wire

    @property
    def stores_other_dtypes(self) -> bool:
        """Whether commits store a fragment tensor in another dtype than the model's (one
        not in :data:`OUTER_DTYPE`): then the wire names ``outer_dtype``."""
        return any(spec.dtype != OUTER_DTYPE for fragment in self.fragments for spec in fragment)

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
    """One combined contribution; ``grid``: a Moshpit group member's grid index."""

    learner: str
    samples: int
    payload: str
    grid: tuple[int, ...] | None = None

    def to_wire(self) -> ContributionWire:
        wire: ContributionWire = {
            "learner": self.learner,
            "samples": self.samples,
            "payload": self.payload,
        }
        if self.grid is not None:
            wire["grid"] = list(self.grid)
        return wire


@dataclass(frozen=True)
class Exclusion:
    """A contribution the closer listed but could not use: ``key`` is its snapshot record,
    ``learner`` the key's last segment (not necessarily a valid id), ``reason`` why (a
    corrupt or missing payload, a malformed record). Informational: it is not combined."""

    learner: str
    key: str
    reason: str


@dataclass(frozen=True)
class Totals:
    """A fragment's running totals, up to and including one commit: ``rounds``, its training
    commits (rounds ``>= P``: the initial commits do not count); ``samples``, the samples of
    every contribution those commits combined (``Commit.samples`` summed). Each sample a
    learner trains goes into one round of every fragment, so a fragment's ``samples`` count
    each sample once.

    A closer writes them as its base's totals plus its own round (:meth:`after`); an
    initial commit's are zero, written or not. Readers take a status from the newest commit
    of each fragment instead of summing every record (``gradientmail.inspect``)."""

    rounds: int
    samples: int

    def after(self, samples: int) -> Totals:
        """These totals followed by one training commit of ``samples`` samples."""
        return Totals(self.rounds + 1, self.samples + samples)

    def to_wire(self) -> TotalsWire:
        return {"rounds": self.rounds, "samples": self.samples}


NO_TOTALS = Totals(0, 0)  # an initial commit's


@dataclass(frozen=True)
class Commit:
    """Round ``round``'s result for ``fragment``: new parameters and outer momentum.

    Recomputable from this record and the commit of round ``base`` (``round - P``): only
    ``contributors`` are combined; ``excluded`` lists snapshots of the round the closer
    could not load or verify, and why. Rounds ``< P`` are the initial commits: ``base`` is
    ``None`` and there are no contributors.

    ``totals``: the fragment's running totals including this round (:class:`Totals`), or
    ``None`` when not known: a record written before they existed, or built on one (a
    closer computes them from its base's only). Left out of the wire when ``None``.

    ``stored``: whether the payload ``params`` names is in the mailbox. A stateless
    compressed algorithm's closer writes the parameters only every ``dense_every`` rounds
    of a fragment (``SparseLoCo(dense_every=K)``); the other records still name the key
    those parameters have (their hash), and readers compute them from the newest stored
    commit before them and the rounds' contributions (``engine/chain.py``). Left out of the
    wire when true.

    ``group``: set on a Moshpit group round's commit (``group-rounds/{t}/{group}``):
    ``round`` is the group round ``t``, ``contributors`` the members it averaged, ``base``
    None, ``momentum`` None. Left out of the wire when ``None``.
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
    totals: Totals | None = None
    stored: bool = True
    group: str | None = None

    @property
    def samples(self) -> int:
        return sum(c.samples for c in self.contributors)

    def running_totals(self, fragments: int) -> Totals | None:
        """The fragment's totals up to this commit: the record's, zero for an initial commit
        (round ``< fragments``) that carries none, ``None`` when unknown."""
        if self.totals is None and self.round < fragments:
            return NO_TOTALS
        return self.totals

    def to_wire(self) -> CommitWire:
        wire: CommitWire = {
            "format": self.format,
            "round": self.round,
            "fragment": self.fragment,
            "base": self.base,
            "contributors": [c.to_wire() for c in self.contributors],
            "params": self.params,
            "momentum": self.momentum,
            "closer": self.closer,
            "attempt": self.attempt,
        }
        if self.excluded:
            wire["excluded"] = [
                {"learner": x.learner, "key": x.key, "reason": x.reason} for x in self.excluded
            ]
        if self.totals is not None:
            wire["totals"] = self.totals.to_wire()
        if not self.stored:
            wire["stored"] = False
        if self.group is not None:
            wire["group"] = self.group
        return wire


@dataclass(frozen=True)
class Snapshot:
    """A contribution: ``base`` is the round the learner built on; ``grid`` its grid index
    in a Moshpit group round (``None`` otherwise: left out of the wire)."""

    round: int
    learner: str
    samples: int
    payload: str
    base: int
    grid: tuple[int, ...] | None = None

    def to_wire(self) -> SnapshotWire:
        wire: SnapshotWire = {
            "round": self.round,
            "learner": self.learner,
            "samples": self.samples,
            "payload": self.payload,
            "base": self.base,
        }
        if self.grid is not None:
            wire["grid"] = list(self.grid)
        return wire


@dataclass(frozen=True)
class Claim:
    learner: str

    def to_wire(self) -> ClaimWire:
        return {"learner": self.learner}


@dataclass(frozen=True)
class RoundFailure:
    """Round ``round`` cannot be made by anyone: its closer (``closer``, claim ``attempt``)
    failed the same way on every try for a reason in the run's data (a payload whose dtype
    or shape is not the run's, a record that breaks the protocol), not the store's. Created
    once, beside the round's claims (``keys.failure_key``); every learner in the round
    raises ``reason`` from ``step()``."""

    round: int
    closer: str
    attempt: int
    reason: str
    format: int = FORMAT_VERSION

    def to_wire(self) -> RoundFailureWire:
        return {
            "format": self.format,
            "round": self.round,
            "closer": self.closer,
            "attempt": self.attempt,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Beat:
    """A heartbeat, with the learner's counters so far (``gradientmail status`` shows them).

    ``sync_points``: sync points its training reached; ``contributed``: contributions it
    made at them; ``waited_s``: seconds ``step()`` waited at them; ``skipped``: sync points
    it let pass without contributing; ``bytes_up``/``bytes_down``: what it moved to and
    from the mailbox. Beats written before these existed read as 0.
    """

    learner: str
    steps: int = 0
    samples: int = 0
    leaving: bool = False
    sync_points: int = 0
    contributed: int = 0
    waited_s: float = 0.0
    skipped: int = 0
    bytes_up: int = 0
    bytes_down: int = 0

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
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
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
