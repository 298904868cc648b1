"""The node environment: one contract between whoever starts nodes and the nodes.

The Kubernetes operator and ``gradientmail run`` start node processes with these
environment variables; a node reads them with :meth:`NodeEnv.from_environ`. Credentials
never appear here: S3 nodes get the standard ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (from a Secret, by reference) and boto3 reads them itself.

==============================  ==========================================================
variable                        meaning
==============================  ==========================================================
``GRADIENTMAIL_MAILBOX``        mailbox URL (``s3://bucket/prefix?endpoint=…``, ``file://…``)
``GRADIENTMAIL_LEARNER_ID``     this node's learner id (stable across restarts: it rejoins)
``GRADIENTMAIL_NODE_INDEX``     0-based index of this node
``GRADIENTMAIL_NODES``          how many nodes the run was started with
``GRADIENTMAIL_BARRIERS``       ``name=parties`` pairs, comma-separated (``start=3,done=3``)
``GRADIENTMAIL_ALGORITHM``      ``diloco`` (also when unset) or ``moshpit``
``GRADIENTMAIL_SYNC_EVERY``     ``sync_every`` (local steps between syncs)
``GRADIENTMAIL_FRAGMENTS``      DiLoCo ``fragments``
``GRADIENTMAIL_OUTER_LR``       DiLoCo ``outer_lr``
``GRADIENTMAIL_OUTER_MOMENTUM`` DiLoCo ``outer_momentum``
``GRADIENTMAIL_QUORUM``         Session ``quorum_size`` (DiLoCo)
``GRADIENTMAIL_ROUND_TIMEOUT``  Session ``round_timeout`` (seconds)
``GRADIENTMAIL_STEPS``          training steps of the built-in node
``GRADIENTMAIL_GROUP_SIZE``     Moshpit ``group_size``
``GRADIENTMAIL_GRID_DIMS``      Moshpit ``grid_dims``
==============================  ==========================================================

Every variable is always set; the algorithm's own are read by its algorithm alone. An
environment without ``GRADIENTMAIL_ALGORITHM`` (a launcher that predates Moshpit) means
DiLoCo.

A training script of your own reads the same environment in two lines::

    env = gradientmail.node.NodeEnv.from_environ()
    with env.session(model) as session:   # Session(model, algorithm=…, mailbox=…, …)
        ...

(``algorithm=`` is :meth:`NodeEnv.build_algorithm`: ``gm.DiLoCo(…)`` or ``gm.Moshpit(…)``),
and ``env.barrier().wait("start", parties=env.parties("start"))`` lines nodes up.

The built-in node (``python -m gradientmail.node``) reads it the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.patterns._keys import check_segment
from gradientmail.patterns.barrier import Barrier
from gradientmail.wire import check_learner_id

if TYPE_CHECKING:
    import torch

    from gradientmail.algorithms import Algorithm
    from gradientmail.session import Session

__all__ = ["NodeEnv", "NodeEnvError"]

PREFIX = "GRADIENTMAIL_"
ALGORITHMS = ("diloco", "moshpit")
# gradientmail.algorithms.moshpit's bounds (that module needs torch; this one does not;
# tests/launch/test_moshpit_launch.py checks that they agree).
MAX_GROUP_SIZE = 1000
MAX_GRID_DIMS = 8


class NodeEnvError(ValueError):
    """An environment variable of the node contract is missing or malformed."""


def _parse_barriers(text: str) -> dict[str, int]:
    barriers: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, sep, count = item.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise NodeEnvError(f"{PREFIX}BARRIERS: {item!r} is not name=parties with parties >= 1")
        check_segment(name.strip(), "barrier name")
        barriers[name.strip()] = int(count)
    return barriers


@dataclass(frozen=True)
class NodeEnv:
    mailbox: str
    learner_id: str
    node_index: int = 0
    nodes: int = 1
    barriers: Mapping[str, int] = field(default_factory=dict)
    sync_every: int = 100
    fragments: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    quorum: int = 1
    round_timeout: float = 10.0
    steps: int = 200
    algorithm: str = "diloco"  # one of ALGORITHMS
    group_size: int = 4  # Moshpit
    grid_dims: int = 2  # Moshpit

    def __post_init__(self) -> None:
        check_learner_id(self.learner_id)
        if self.algorithm not in ALGORITHMS:
            raise NodeEnvError(
                f"{PREFIX}ALGORITHM={self.algorithm!r}: the algorithms are {', '.join(ALGORITHMS)}"
            )
        if not 2 <= self.group_size <= MAX_GROUP_SIZE:
            raise NodeEnvError(
                f"{PREFIX}GROUP_SIZE={self.group_size} is not within 2..{MAX_GROUP_SIZE}"
            )
        if not 1 <= self.grid_dims <= MAX_GRID_DIMS:
            raise NodeEnvError(
                f"{PREFIX}GRID_DIMS={self.grid_dims} is not within 1..{MAX_GRID_DIMS}"
            )
        if self.nodes < 1 or not 0 <= self.node_index < self.nodes:
            raise NodeEnvError(f"node index {self.node_index} is not within 0..{self.nodes - 1}")
        for name, parties in self.barriers.items():
            check_segment(name, "barrier name")
            if parties < 1:
                raise NodeEnvError(f"barrier {name!r} needs parties >= 1, not {parties}")

    # -- the wire: environment variables -------------------------------------------------

    def to_environ(self) -> dict[str, str]:
        return {
            f"{PREFIX}MAILBOX": self.mailbox,
            f"{PREFIX}LEARNER_ID": self.learner_id,
            f"{PREFIX}NODE_INDEX": str(self.node_index),
            f"{PREFIX}NODES": str(self.nodes),
            f"{PREFIX}BARRIERS": ",".join(f"{k}={v}" for k, v in self.barriers.items()),
            f"{PREFIX}SYNC_EVERY": str(self.sync_every),
            f"{PREFIX}FRAGMENTS": str(self.fragments),
            f"{PREFIX}OUTER_LR": repr(self.outer_lr),
            f"{PREFIX}OUTER_MOMENTUM": repr(self.outer_momentum),
            f"{PREFIX}QUORUM": str(self.quorum),
            f"{PREFIX}ROUND_TIMEOUT": repr(self.round_timeout),
            f"{PREFIX}STEPS": str(self.steps),
            f"{PREFIX}ALGORITHM": self.algorithm,
            f"{PREFIX}GROUP_SIZE": str(self.group_size),
            f"{PREFIX}GRID_DIMS": str(self.grid_dims),
        }

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> NodeEnv:
        env = os.environ if environ is None else environ

        def raw(name: str, default: str | None = None) -> str:
            value = env.get(PREFIX + name, default)
            if value is None or value == "":
                raise NodeEnvError(f"{PREFIX}{name} is not set; the node cannot start")
            return value

        def number(name: str, kind: type[Any], default: Any) -> Any:
            text = raw(name, str(default))
            try:
                return kind(text)
            except ValueError:
                raise NodeEnvError(f"{PREFIX}{name}={text!r} is not a {kind.__name__}") from None

        try:
            return cls(
                mailbox=raw("MAILBOX"),
                learner_id=raw("LEARNER_ID"),
                node_index=number("NODE_INDEX", int, 0),
                nodes=number("NODES", int, 1),
                barriers=_parse_barriers(env.get(PREFIX + "BARRIERS", "")),
                sync_every=number("SYNC_EVERY", int, cls.sync_every),
                fragments=number("FRAGMENTS", int, cls.fragments),
                outer_lr=number("OUTER_LR", float, cls.outer_lr),
                outer_momentum=number("OUTER_MOMENTUM", float, cls.outer_momentum),
                quorum=number("QUORUM", int, cls.quorum),
                round_timeout=number("ROUND_TIMEOUT", float, cls.round_timeout),
                steps=number("STEPS", int, cls.steps),
                algorithm=env.get(PREFIX + "ALGORITHM", "") or cls.algorithm,
                group_size=number("GROUP_SIZE", int, cls.group_size),
                grid_dims=number("GRID_DIMS", int, cls.grid_dims),
            )
        except NodeEnvError:
            raise
        except ValueError as exc:
            raise NodeEnvError(f"node environment: {exc}") from exc

    # -- what a node builds from it ------------------------------------------------------

    def open_mailbox(self) -> Mailbox:
        return open_mailbox(self.mailbox)

    def parties(self, barrier: str) -> int:
        return self.barriers.get(barrier, self.nodes)

    def barrier(self, mailbox: Mailbox | None = None, poll_interval: float = 1.0) -> Barrier:
        return Barrier(
            mailbox=mailbox or self.open_mailbox(),
            learner_id=self.learner_id,
            poll_interval=poll_interval,
        )

    def build_algorithm(self) -> Algorithm:
        """``gm.Moshpit(sync_every, group_size, grid_dims)`` for a Moshpit run, else
        ``gm.DiLoCo(sync_every, fragments, outer_lr, outer_momentum)``: what every node's
        Session runs (and what ``gradientmail run`` matches against a run's manifest)."""
        if self.algorithm == "moshpit":
            from gradientmail.algorithms.moshpit import Moshpit

            return Moshpit(
                sync_every=self.sync_every, group_size=self.group_size, grid_dims=self.grid_dims
            )
        from gradientmail.algorithms import DiLoCo

        return DiLoCo(
            sync_every=self.sync_every,
            fragments=self.fragments,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
        )

    def session(
        self, model: torch.nn.Module, mailbox: Mailbox | None = None, **options: Any
    ) -> Session:
        from gradientmail.session import Session

        options.setdefault("quorum_size", self.quorum)  # Moshpit's group rounds have none
        options.setdefault("round_timeout", self.round_timeout)
        return Session(
            model,
            algorithm=self.build_algorithm(),
            mailbox=mailbox or self.open_mailbox(),
            learner_id=self.learner_id,
            **options,
        )
