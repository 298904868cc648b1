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
``GRADIENTMAIL_ALGORITHM``      ``diloco`` (also when unset), ``sparseloco`` or ``moshpit``
``GRADIENTMAIL_{SETTING}``      each algorithm setting of the registry, upper-cased
                                (``SYNC_EVERY``, ``FRAGMENTS``, ``OUTER_LR``, ``BUFFERS``,
                                ``ERROR_DECAY``, ``DENSE_EVERY``, ``GROUP_SIZE``, …)
``GRADIENTMAIL_COMPRESSION``    the compressor (``topk:density=0.02,bits=2``, ``none``;
                                empty: the algorithm's default)
``GRADIENTMAIL_QUORUM``         Session ``quorum_size`` (run-wide rounds)
``GRADIENTMAIL_ROUND_TIMEOUT``  Session ``round_timeout`` (seconds)
``GRADIENTMAIL_OVERLAP``        Session ``overlap`` (run-wide rounds)
``GRADIENTMAIL_MIXING``         Session ``mixing`` (``none``, or α in [0, 1))
``GRADIENTMAIL_KEEP_ROUNDS``    Session ``keep_rounds``
``GRADIENTMAIL_STEPS``          training steps of the built-in node
``GRADIENTMAIL_TASK``           the built-in node's task (``lm``, ``synthetic``), when set
``GRADIENTMAIL_LM``             the built-in node's model sizes (``d_model=32,layers=1``)
==============================  ==========================================================

Which settings exist, their defaults and bounds, come from :mod:`gradientmail.settings`; an
empty variable means the default (``OUTER_LR``'s is the algorithm's own: 0.7 for DiLoCo,
1.0 for SparseLoCo). The algorithm's own settings are read by its algorithm alone. An
environment without ``GRADIENTMAIL_ALGORITHM`` (a launcher that predates Moshpit) means
DiLoCo.

A training script of your own reads the same environment in two lines::

    env = gradientmail.NodeEnv.from_environ()
    with env.session(model) as session:   # Session(model, algorithm=…, mailbox=…, …)
        ...

(``algorithm=`` is :meth:`NodeEnv.build_algorithm`: the run's ``gm.DiLoCo(…)``,
``gm.SparseLoCo(…)`` or ``gm.Moshpit(…)``, with its compressor; a Session whose algorithm
differs from the run's is refused at join, naming both values),
and ``env.barrier().wait("start", parties=env.parties("start"))`` lines nodes up.

The built-in node (``python -m gradientmail.demo.node``) reads it the same way.

A node of ``spec.procsPerNode`` P > 1 (:mod:`gradientmail.launch.ranks`) gives each of its
P ranks this same environment, so every rank is the same learner, plus torchrun's
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gradientmail import settings
from gradientmail.mailbox import Mailbox
from gradientmail.mailbox.url import open_mailbox
from gradientmail.patterns._keys import check_segment
from gradientmail.patterns.barrier import Barrier
from gradientmail.settings import Setting, compression_from_text
from gradientmail.wire import check_learner_id

if TYPE_CHECKING:
    import torch

    from gradientmail.algorithms import Algorithm
    from gradientmail.session import Session

__all__ = ["NodeEnv", "NodeEnvError", "launched_differences"]

PREFIX = "GRADIENTMAIL_"
ALGORITHMS: tuple[str, ...] = tuple(settings.ALGORITHMS)
MAX_GROUP_SIZE = settings.MAX_GROUP_SIZE
MAX_GRID_DIMS = settings.MAX_GRID_DIMS
TASK_VAR = PREFIX + "TASK"
LM_VAR = PREFIX + "LM"


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


def _registry() -> dict[str, Setting]:
    """Every registry setting the environment carries, by name (an algorithm field's entry is
    its first algorithm's: the bounds agree; the defaults are NodeEnv's own)."""
    found: dict[str, Setting] = {}
    for info in settings.ALGORITHMS.values():
        for setting in info.fields:
            found.setdefault(setting.name, setting)
    for setting, _ in settings.SESSION.values():
        found[setting.name] = setting
    found["steps"] = settings.NODE["steps"]
    return found


_SETTINGS = _registry()


@dataclass(frozen=True)
class NodeEnv:
    mailbox: str
    learner_id: str
    node_index: int = 0
    nodes: int = 1
    barriers: Mapping[str, int] = field(default_factory=dict)
    algorithm: str = "diloco"  # one of ALGORITHMS
    # The algorithms' settings (gradientmail.settings.ALGORITHMS); each is read only by the
    # algorithms that have it.
    sync_every: int = 100
    fragments: int = 1
    outer_lr: float | None = None  # None: the algorithm's own default
    outer_momentum: float = 0.9
    nesterov: bool = True
    buffers: str = "average"
    error_decay: float = 0.95
    dense_every: int = 1
    group_size: int = 4
    grid_dims: int = 2
    compression: str = ""  # compression_to_text's line; "": the algorithm's default
    # Per-learner Session settings (gradientmail.settings.SESSION).
    quorum: int = 1
    round_timeout: float = 10.0
    overlap: int = 0
    mixing: float | None = None
    keep_rounds: int = 2
    # The built-in node's own (gradientmail.settings.NODE): "" leaves its default.
    steps: int = 200
    task: str = ""
    lm: str = ""

    def __post_init__(self) -> None:
        check_learner_id(self.learner_id)
        if self.algorithm not in ALGORITHMS:
            raise NodeEnvError(
                f"{PREFIX}ALGORITHM={self.algorithm!r}: the algorithms are {', '.join(ALGORITHMS)}"
            )
        for name, setting in _SETTINGS.items():
            value = getattr(self, name)
            # outer_lr None: the algorithm's own default.
            if not (value is None and name == "outer_lr") and not setting.valid(value):
                raise NodeEnvError(f"{setting.env_var}={value!r} must be {setting.rule()}")
        if self.compression:
            try:
                compression_from_text(self.compression)
            except ValueError as exc:
                raise NodeEnvError(f"{PREFIX}COMPRESSION={self.compression!r}: {exc}") from None
        if self.task and not settings.NODE["task"].valid(self.task):
            raise NodeEnvError(f"{TASK_VAR}={self.task!r} must be {settings.NODE['task'].rule()}")
        if self.nodes < 1 or not 0 <= self.node_index < self.nodes:
            raise NodeEnvError(f"node index {self.node_index} is not within 0..{self.nodes - 1}")
        for name, parties in self.barriers.items():
            check_segment(name, "barrier name")
            if parties < 1:
                raise NodeEnvError(f"barrier {name!r} needs parties >= 1, not {parties}")

    # -- the wire: environment variables -------------------------------------------------

    def to_environ(self) -> dict[str, str]:
        """Every variable of the contract (an empty one: the default); ``GRADIENTMAIL_TASK``
        and ``GRADIENTMAIL_LM`` only when set, so a launcher's own pass through."""
        environ = {
            f"{PREFIX}MAILBOX": self.mailbox,
            f"{PREFIX}LEARNER_ID": self.learner_id,
            f"{PREFIX}NODE_INDEX": str(self.node_index),
            f"{PREFIX}NODES": str(self.nodes),
            f"{PREFIX}BARRIERS": ",".join(f"{k}={v}" for k, v in self.barriers.items()),
            f"{PREFIX}ALGORITHM": self.algorithm,
            f"{PREFIX}COMPRESSION": self.compression,
        }
        for name, setting in _SETTINGS.items():
            value = getattr(self, name)
            environ[setting.env_var] = (
                ("none" if setting.nullable else "") if value is None else str(value)
            )
        if self.task:
            environ[TASK_VAR] = self.task
        if self.lm:
            environ[LM_VAR] = self.lm
        return environ

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

        values: dict[str, Any] = {}
        for name, setting in _SETTINGS.items():
            text = env.get(setting.env_var, "")
            if text == "":
                continue  # unset: NodeEnv's default
            try:
                values[name] = setting.parse(text)
            except ValueError as exc:
                raise NodeEnvError(f"{setting.env_var}={exc}") from None
        try:
            return cls(
                mailbox=raw("MAILBOX"),
                learner_id=raw("LEARNER_ID"),
                node_index=number("NODE_INDEX", int, 0),
                nodes=number("NODES", int, 1),
                barriers=_parse_barriers(env.get(PREFIX + "BARRIERS", "")),
                algorithm=env.get(PREFIX + "ALGORITHM", "") or cls.algorithm,
                compression=env.get(PREFIX + "COMPRESSION", ""),
                task=env.get(TASK_VAR, ""),
                lm=env.get(LM_VAR, ""),
                **values,
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

    def algorithm_settings(self) -> dict[str, Any]:
        """The run's algorithm as the manifest's ``algorithm`` input (``from_settings``):
        its name, its own settings from this environment (the registry says which), its
        compressor when set."""
        info = settings.algorithm_info(self.algorithm)
        values: dict[str, Any] = {"name": self.algorithm}
        for setting in info.fields:
            value = getattr(self, setting.name)
            if value is not None:
                values[setting.name] = value
        if info.compression != "none" and self.compression:
            compression = compression_from_text(self.compression)
            if compression is not None:
                values["compression"] = compression
            elif info.compression == "required":
                raise NodeEnvError(
                    f"{PREFIX}COMPRESSION=none: {info.title} needs a compressor "
                    f"({', '.join(settings.COMPRESSORS)})"
                )
        return values

    def build_algorithm(self) -> Algorithm:
        """The run's algorithm (DiLoCo, SparseLoCo or Moshpit, with its compressor): what
        every node's Session runs, and what ``gradientmail run`` matches against a run's
        manifest."""
        from gradientmail.algorithms import from_manifest

        return from_manifest(self.algorithm_settings())

    def session_options(self) -> dict[str, Any]:
        """The Session settings of this environment that apply to the run's exchange."""
        options: dict[str, Any] = {"round_timeout": self.round_timeout}
        options["keep_rounds"] = self.keep_rounds
        if settings.applies("quorum", self.algorithm):
            options["quorum_size"] = self.quorum
        if settings.applies("overlap", self.algorithm):
            options["overlap"] = self.overlap
            options["mixing"] = self.mixing
        return options

    def session(
        self, model: torch.nn.Module, mailbox: Mailbox | None = None, **options: Any
    ) -> Session:
        from gradientmail.session import Session

        for key, value in self.session_options().items():
            options.setdefault(key, value)
        return Session(
            model,
            algorithm=self.build_algorithm(),
            mailbox=mailbox or self.open_mailbox(),
            learner_id=self.learner_id,
            **options,
        )


def launched_differences(
    learner_id: str, algorithm: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> list[str]:
    """How ``algorithm`` (a Session's settings) differs from the run this process was
    launched into: when ``gradientmail run`` or the operator started it as ``learner_id``
    (its ``GRADIENTMAIL_LEARNER_ID``), the run's settings are the environment's, and a
    script that built another algorithm would train something other than what the launcher
    shows. Empty when it matches, or when this process was not launched as that learner."""
    env = os.environ if environ is None else environ
    if env.get(PREFIX + "LEARNER_ID") != learner_id or not env.get(PREFIX + "ALGORITHM"):
        return []
    launched = NodeEnv.from_environ(env).build_algorithm().settings()
    found = []
    for name in sorted(set(launched) | set(algorithm)):
        theirs, mine = launched.get(name), algorithm.get(name)
        if theirs != mine:
            var = "ALGORITHM" if name == "name" else name.upper()
            found.append(
                f"algorithm {name}: the run has {theirs!r} ({PREFIX}{var}), this node has {mine!r}"
            )
    return found
