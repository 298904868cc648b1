"""The GradientMailRun spec, as pydantic models: the single source of the CRD schema.

The operator's ``crd.py`` renders :class:`GradientMailRunSpec` into the CRD's
``openAPIV3Schema``; the operator parses every resource it sees with the same models, and
so does ``gradientmail run -f run.yaml``: a spec the CRD accepts is a spec both understand,
and an unknown field is refused by name.

The pure derivations from a spec to what a node sees (:func:`mailbox_url`,
:func:`learner_id`, :func:`node_env`, :func:`ranks_problem`: which commands may run as
``procsPerNode`` ranks) live here too, so the operator's pods and ``gradientmail run``'s
local processes get the same environment.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal
from urllib.parse import urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gradientmail import settings
from gradientmail.launch.env import LM_VAR, TASK_VAR, NodeEnv
from gradientmail.launch.ranks import RANKS_MODULE
from gradientmail.settings import Setting, camel, compression_to_text

GROUP = "gradientmail.dev"
VERSION = "v1alpha1"
KIND = "GradientMailRun"
PLURAL = "gradientmailruns"
SINGULAR = "gradientmailrun"
SHORT_NAMES = ["gmr"]

DEFAULT_IMAGE = "ghcr.io/gradientmail/node:0.1.0"
DEFAULT_COMMAND = ["python", "-m", "gradientmail.demo.node"]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=camel, populate_by_name=True, frozen=True
    )


class EnvVar(_Model):
    """An environment variable with a literal value (use ``valueFrom`` for secrets)."""

    name: str = Field(min_length=1, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef).",
    )


class Toleration(_Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(_Model):
    requests: dict[str, str | int] | None = Field(
        default=None, description="e.g. cpu: 2, memory: 8Gi, nvidia.com/gpu: 1"
    )
    limits: dict[str, str | int] | None = Field(
        default=None, description="e.g. memory: 8Gi, nvidia.com/gpu: 1"
    )


class LocalObjectReference(_Model):
    name: str = Field(min_length=1)


_FREE_FORM = "Kubernetes {what}, as in a pod spec; passed through as given."


class PodTemplate(_Model):
    """What each node pod runs. Defaults run the built-in node (``gradientmail.demo.node``)."""

    # The fields a PyTorchJob or JobSet user writes for a pod and its container, by the same
    # names. Kubernetes objects (volumes, affinity, security contexts, ...) are taken as
    # given: the API server validates them when the pod is created. Only what the operator
    # relies on is checked here: volumes have unique names, every volume mount names a
    # declared volume, GRADIENTMAIL_* variables are the operator's.

    image: str = Field(default=DEFAULT_IMAGE, min_length=1, description="Node image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None, description="Secrets to pull the node image with ({name: regcred})."
    )
    command: list[str] = Field(default_factory=lambda: list(DEFAULT_COMMAND))
    args: list[str] = Field(default_factory=list)
    working_dir: str | None = Field(default=None, description="The container's working dir.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment.")
    env_from: list[dict[str, Any]] | None = Field(
        default=None,
        description=_FREE_FORM.format(what="EnvFromSources (configMapRef, secretRef, prefix)"),
    )
    resources: Resources | None = None
    volumes: list[dict[str, Any]] | None = Field(
        default=None, description=_FREE_FORM.format(what="Volumes (each a name and one source)")
    )
    volume_mounts: list[dict[str, Any]] | None = Field(
        default=None,
        description=_FREE_FORM.format(
            what="VolumeMounts (each the name of a volume and a mountPath)"
        ),
    )
    node_selector: dict[str, str] | None = None
    affinity: dict[str, Any] | None = Field(
        default=None, description=_FREE_FORM.format(what="Affinity")
    )
    tolerations: list[Toleration] | None = None
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    service_account_name: str | None = None
    security_context: dict[str, Any] | None = Field(
        default=None,
        description=(
            "The container's SecurityContext. Replaces the restricted default (non-root, "
            "no privilege escalation, all capabilities dropped, RuntimeDefault seccomp)."
        ),
    )
    pod_security_context: dict[str, Any] | None = Field(
        default=None,
        description=(
            "The pod's PodSecurityContext. Replaces the restricted default (runAsNonRoot, "
            "user, group and fsGroup 1000, RuntimeDefault seccomp)."
        ),
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra pod labels.")
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _no_reserved_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        for var in env:
            # The built-in node's own settings (its task, its model's sizes) are not the
            # contract's: a pod may set them (or spec.algorithm.task / .lm).
            if var.name.startswith("GRADIENTMAIL_") and var.name not in (TASK_VAR, LM_VAR):
                raise ValueError(
                    f"env {var.name}: GRADIENTMAIL_* variables are set by the operator "
                    f"(except {TASK_VAR} and {LM_VAR}: spec.algorithm.task and .lm set them too)"
                )
        return env

    @field_validator("volumes")
    @classmethod
    def _named_volumes(cls, volumes: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        seen: set[str] = set()
        for i, volume in enumerate(volumes or []):
            name = volume.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"template.volumes[{i}] has no name")
            if name in seen:
                raise ValueError(f"template.volumes: the name {name!r} is used twice")
            seen.add(name)
        return volumes

    @field_validator("volume_mounts")
    @classmethod
    def _complete_mounts(cls, mounts: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, mount in enumerate(mounts or []):
            name, path = mount.get("name"), mount.get("mountPath")
            if not isinstance(name, str) or not name:
                raise ValueError(f"template.volumeMounts[{i}] has no name (of a volume)")
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError(
                    f"template.volumeMounts[{i}] ({name!r}) needs an absolute mountPath"
                )
        return mounts

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> PodTemplate:
        declared = {v["name"] for v in self.volumes or []}
        for mount in self.volume_mounts or []:
            if mount["name"] not in declared:
                raise ValueError(
                    f"template.volumeMounts: the mount {mount['name']!r} at "
                    f"{mount['mountPath']} names no volume in template.volumes"
                    + (f" (declared: {', '.join(sorted(declared))})" if declared else "")
                )
        return self


class SecretRef(_Model):
    """The Secret holding S3 credentials; the operator passes it by reference only."""

    name: str = Field(min_length=1)
    access_key_id_key: str = Field(default="AWS_ACCESS_KEY_ID")
    secret_access_key_key: str = Field(default="AWS_SECRET_ACCESS_KEY")


class MailboxSpec(_Model):
    """Where the run's mailbox lives: a URL, or endpoint + bucket (+ base prefix).

    Each run gets its own prefix under the base prefix, derived from namespace, name and uid.
    """

    url: str | None = Field(default=None, description="s3://bucket/base?endpoint=… or file://")
    endpoint: str | None = Field(default=None, description="S3 endpoint URL (non-AWS stores).")
    bucket: str | None = None
    prefix: str = Field(default="gradientmail", description="Base prefix for runs.")
    region: str | None = None
    credentials_secret: SecretRef | None = None
    poll_status: bool = Field(
        default=True,
        description=(
            "The operator polls the mailbox to show rounds and learners in the status; this "
            "reads the credentials Secret. false: no Secret read, no mailbox access by the "
            "operator (the status shows pods only)."
        ),
    )

    @model_validator(mode="after")
    def _url_or_bucket(self) -> MailboxSpec:
        if (self.url is None) == (self.bucket is None):
            raise ValueError("give either mailbox.url or mailbox.bucket (with endpoint)")
        if self.url is not None and not self.url.startswith(("s3://", "file://")):
            raise ValueError(f"mailbox.url {self.url!r} must start with s3:// or file://")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"mailbox.endpoint {self.endpoint!r} must be an http(s) URL")
        if any(part in ("", ".", "..") for part in self.prefix.strip("/").split("/")):
            raise ValueError(f"mailbox.prefix {self.prefix!r} has an empty or dot segment")
        return self


# -- the algorithm and Session settings, derived from gradientmail.settings ----------------


def _setting(name: str, algorithm: str | None = None) -> Setting:
    """The registry's entry for a spec field (an algorithm field: ``algorithm``'s own when
    it has one, else its first owner's; the kinds and bounds agree)."""
    if name in settings.SESSION:
        return settings.SESSION[name][0]
    if name in settings.NODE:
        return settings.NODE[name]
    infos = list(settings.ALGORITHMS.values())
    if algorithm in settings.ALGORITHMS:
        infos.insert(0, settings.ALGORITHMS[algorithm])
    for info in infos:
        for setting in info.fields:
            if setting.name == name:
                return setting
    raise KeyError(name)


def _spec_default(name: str) -> Any:
    """The spec's default: the registry's when every algorithm that has the setting agrees,
    else None (each algorithm's own: ``outerLr`` is 0.7 for DiLoCo, 1.0 for SparseLoCo)."""
    if name in settings.SESSION or name in settings.NODE:
        return _setting(name).default
    values = {
        repr(info.field(name).default)
        for info in settings.ALGORITHMS.values()
        if name in info.names
    }
    return _setting(name).default if len(values) == 1 else None


def _bounds(setting: Setting) -> dict[str, Any]:
    """The JSON-schema bounds of a setting (the CRD's; the values are checked with the
    registry's own rule, so every place words a bad value alike)."""
    schema: dict[str, Any] = {}
    for key, value in (
        ("minimum", setting.ge),
        ("exclusiveMinimum", setting.gt),
        ("maximum", setting.le),
        ("exclusiveMaximum", setting.lt),
    ):
        if value is not None:
            schema[key] = int(value) if setting.kind == "int" else value
    if setting.kind == "choice" and isinstance(setting.choices[0], int):
        schema["enum"] = list(setting.choices)
    return schema


def _applies_to(name: str) -> str:
    owners = settings.owners(name)
    if len(owners) == len(settings.ALGORITHMS):
        return ""
    return "/".join(settings.ALGORITHMS[o].title for o in owners) + " only: "


def _field(name: str) -> Any:
    setting = _setting(name)
    default = _spec_default(name)
    description = _applies_to(name) + setting.description
    if default is None and name not in settings.SESSION and name not in settings.NODE:
        description += " Default: " + ", ".join(
            f"{info.title} {info.field(name).default!r}"
            for info in settings.ALGORITHMS.values()
            if name in info.names
        )
    return Field(
        default=default,
        description=description,
        json_schema_extra=_bounds(setting) or None,
    )


def _other_algorithm(name: str, algorithm: str, default: Any) -> str:
    """The one refusal of a setting the run's algorithm does not have."""
    owners = settings.owners(name)
    titles = "/".join(settings.ALGORITHMS[o].title for o in owners)
    info = settings.ALGORITHMS[algorithm]
    return (
        f"a {titles} setting, and this run is {info.title} (algorithm.name: {algorithm}); "
        f"leave it out{'' if default is None else f' (or at {default!r})'}, or set "
        f"algorithm.name: {owners[0]}"
    )


class CompressionSpec(_Model):
    """A compressor of the pseudo-gradients (DiLoCo: optional; SparseLoCo: top-k by
    default). Only the named compressor's own fields may be given."""

    name: Literal["topk", "cast", "quantize"] = Field(
        description="; ".join(f"{c.name}: {c.description}" for c in settings.COMPRESSORS.values())
    )
    density: float | None = Field(default=None, description="topk: fraction of each chunk kept.")
    bits: int | None = Field(default=None, description="topk: 2, 4 or 8; quantize: 8 or 4.")
    chunk: int | None = Field(default=None, description="topk, quantize: elements per chunk.")
    dtype: Literal["bfloat16", "float16"] | None = Field(
        default=None, description="cast: the 16-bit float type."
    )

    @field_validator("density", "bits", "chunk", "dtype")
    @classmethod
    def _of_this_compressor(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.data.get("name")
        if value is None or name is None:
            return value
        compressor = settings.compressor_info(name)
        field = info.field_name
        assert field is not None
        if field not in [f.name for f in compressor.fields]:
            raise ValueError(
                f"not a setting of {compressor.title} (its settings: "
                + ", ".join(f.name for f in compressor.fields)
                + ")"
            )
        setting = compressor.field(field)
        if not setting.valid(value):
            raise ValueError(f"must be {setting.rule()}")
        return value

    def settings(self) -> dict[str, Any]:
        """The compressor's settings as its class reads them (unset fields: defaults)."""
        return self.model_dump(exclude_none=True)


# Defaults the first CRD wrote into every stored resource (outerLr had one then; it is now
# each algorithm's own): still accepted where the setting does not apply.
_LEGACY: dict[str, Any] = {"outer_lr": 0.7}

# Every setting of the spec's algorithm section that the registry describes (``name`` and
# ``compression`` aside), in the order the CRD lists them.
SETTING_FIELDS: tuple[str, ...] = (
    "sync_every",
    "fragments",
    "outer_lr",
    "outer_momentum",
    "nesterov",
    "buffers",
    "error_decay",
    "dense_every",
    "group_size",
    "grid_dims",
    "quorum",
    "round_timeout",
    "overlap",
    "mixing",
    "keep_rounds",
    "steps",
    "task",
)


class AlgorithmSpec(_Model):
    """The algorithm, its settings and the Session settings of every node (the registry,
    :mod:`gradientmail.settings`, describes each)."""

    # One line, `algorithm: {name: moshpit}`, turns a run into Moshpit SGD on a 4 x 4 grid.
    # A setting the algorithm does not have (fragments under Moshpit, groupSize under
    # DiLoCo, ...) is refused by name unless it keeps its default.

    name: Literal["diloco", "sparseloco", "moshpit"] = Field(
        default="diloco",
        description="The algorithm: "
        + "; ".join(f"{i.name}: {i.description}" for i in settings.ALGORITHMS.values()),
    )
    sync_every: int = _field("sync_every")
    fragments: int = _field("fragments")
    outer_lr: float | None = _field("outer_lr")
    outer_momentum: float = _field("outer_momentum")
    nesterov: bool = _field("nesterov")
    buffers: Literal["average", "closer"] = _field("buffers")
    error_decay: float = _field("error_decay")
    dense_every: int = _field("dense_every")
    compression: CompressionSpec | None = Field(
        default=None,
        description=_applies_to("compression")
        + "the compressor (default: none for DiLoCo, topk density 0.02 bits 2 for SparseLoCo).",
    )
    group_size: int = _field("group_size")
    grid_dims: int = _field("grid_dims")
    quorum: int = _field("quorum")
    round_timeout: float = _field("round_timeout")
    overlap: int = _field("overlap")
    mixing: float | None = _field("mixing")
    keep_rounds: int = _field("keep_rounds")
    steps: int = _field("steps")
    task: Literal["lm", "synthetic"] | None = Field(
        default=None,
        description=settings.NODE["task"].description + " Unset: the node's default (lm).",
    )
    lm: str | None = Field(
        default=None,
        description="The built-in node's language model sizes as key=value pairs ("
        + ", ".join(settings.LM_SIZES)
        + "), e.g. d_model=32,layers=1.",
    )

    @field_validator(*SETTING_FIELDS, "compression")
    @classmethod
    def _of_this_algorithm(cls, value: Any, info: ValidationInfo) -> Any:
        # ``name`` is declared first, so it is validated before these (when it failed, only
        # its own error is reported).
        name = info.data.get("name")
        field = info.field_name
        assert field is not None
        if value is None or name is None:
            return value
        default = cls.model_fields[field].default
        legacy = _LEGACY.get(field, default)
        if not settings.applies(field, name) and value not in (default, legacy):
            raise ValueError(_other_algorithm(field, name, default))
        if field != "compression" and field != "task":
            setting = _setting(field, name)
            if not setting.valid(value):
                raise ValueError(f"must be {setting.rule()}")
        return value

    @field_validator("lm")
    @classmethod
    def _lm_sizes(cls, value: str | None) -> str | None:
        for item in (part.strip() for part in (value or "").split(",") if part.strip()):
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or key not in settings.LM_SIZES:
                raise ValueError(
                    f"{item!r} is not key=value with a key among {', '.join(settings.LM_SIZES)}"
                )
            setting = settings.LM_SIZES[key]
            parsed = setting.parse(raw)
            if not setting.valid(parsed):
                raise ValueError(f"{key} must be {setting.rule()}")
        return value

    @model_validator(mode="after")
    def _fits(self) -> AlgorithmSpec:
        if self.fragments > self.sync_every:
            raise ValueError("algorithm.fragments cannot exceed algorithm.syncEvery")
        return self

    def applicable(self) -> dict[str, Any]:
        """The settings that mean something to this run's algorithm, as given (None: the
        algorithm's default)."""
        return {
            field: getattr(self, field)
            for field in (*SETTING_FIELDS, "compression", "lm")
            if settings.applies(field, self.name)
        }

    def algorithm_settings(self) -> dict[str, Any]:
        """The settings the nodes' algorithm is built from (a manifest's ``algorithm``
        input, the defaults filled in): what every node runs."""
        info = settings.algorithm_info(self.name)
        values: dict[str, Any] = {"name": self.name}
        for setting in info.fields:
            value = getattr(self, setting.name)
            values[setting.name] = setting.default if value is None else value
        if self.compression is not None:
            values["compression"] = self.compression.settings()
        elif info.default_compression is not None:
            values["compression"] = dict(info.default_compression)
        return values

    def describe(self) -> str:
        """One line of what the nodes run: ``syncEvery 25, DiLoCo, fragments 2, …``."""
        values = self.algorithm_settings()
        title = settings.algorithm_info(self.name).title
        parts = [f"syncEvery {values.pop('sync_every')}", title]
        values.pop("name")
        compression = values.pop("compression", None)
        parts += [f"{camel(k)} {v}" for k, v in values.items()]
        if compression is not None:
            parts.append(f"compression {compression_to_text(compression)}")
        return ", ".join(parts)


_PROCS = settings.LAUNCH["procs_per_node"]
GPU_RESOURCE = "nvidia.com/gpu"


class GradientMailRunSpec(_Model):
    """A training run: ``nodes`` pods that meet only in the mailbox."""

    nodes: int = Field(ge=1, le=1000, description="Node pods to run.")
    template: PodTemplate = Field(default_factory=PodTemplate)
    mailbox: MailboxSpec
    barriers: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict,
        description="Barrier name → parties (default parties = nodes). The built-in node "
        "waits at start (before training), done (after it) and at any step-N declared here "
        "(right after step N).",
    )
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    procs_per_node: int = Field(
        default=_PROCS.default,
        description=_PROCS.description
        + f" A pod runs `python -m {RANKS_MODULE} --procs P -- COMMAND`; give it P GPUs "
        "(template.resources nvidia.com/gpu: P) where ranks use one each.",
        json_schema_extra=_bounds(_PROCS) or None,
    )
    max_restarts: int = Field(default=3, ge=0, description="Failed pods replaced, run-wide.")
    cleanup_policy: Literal["Retain", "Delete"] = Field(
        default="Retain", description="What happens to the run's prefix on deletion."
    )

    @field_validator("barriers")
    @classmethod
    def _barrier_names(cls, barriers: dict[str, int]) -> dict[str, int]:
        for name in barriers:
            if not _SEGMENT.fullmatch(name):
                raise ValueError(
                    f"barrier name {name!r} must be 1-63 characters of A-Z a-z 0-9 . _ -"
                )
        return barriers

    @field_validator("procs_per_node", mode="before")
    @classmethod
    def _procs(cls, value: Any) -> Any:
        # The registry's rule (a bool or a float is not a count; the CRD says minimum 1).
        if not _PROCS.valid(value):
            raise ValueError(f"must be {_PROCS.rule()}")
        return value

    @model_validator(mode="after")
    def _gpus_per_rank(self) -> GradientMailRunSpec:
        # Each rank takes the GPU of its LOCAL_RANK: a pod given another number of GPUs
        # would leave some idle or put two ranks on one.
        resources = self.template.resources
        if self.procs_per_node == 1 or resources is None:
            return self
        for part in ("limits", "requests"):
            given = (getattr(resources, part) or {}).get(GPU_RESOURCE)
            if given is not None and str(given) != str(self.procs_per_node):
                raise ValueError(
                    f"template.resources.{part} {GPU_RESOURCE}: {given} but procsPerNode is "
                    f"{self.procs_per_node}; each rank of a node uses one GPU (its "
                    f"LOCAL_RANK): ask for {self.procs_per_node}, or leave GPUs out"
                )
        return self

    @model_validator(mode="after")
    def _node_settings_once(self) -> GradientMailRunSpec:
        given = {var.name for var in self.template.env}
        for var, field in ((TASK_VAR, "task"), (LM_VAR, "lm")):
            if var in given and getattr(self.algorithm, field) is not None:
                raise ValueError(
                    f"template.env {var} and algorithm.{field} both set the built-in node's "
                    f"{field}; give one of them"
                )
        return self

    def parties(self) -> dict[str, int]:
        """Every barrier the built-in node uses, with its parties (default: all nodes)."""
        return {"start": self.nodes, "done": self.nodes} | dict(self.barriers)


# -- from a spec to what each node sees (the operator and ``gradientmail run``) -------------


_BUILTIN_MODULES = ("gradientmail.demo.node", "gradientmail.node")


def runs_builtin_node(command: Sequence[str]) -> bool:
    """Whether ``command`` runs the built-in node (``python -m gradientmail.demo.node``, by
    any interpreter, or its old path ``gradientmail.node``)."""
    words = list(command)
    return any(words[i] == "-m" and words[i + 1] in _BUILTIN_MODULES for i in range(len(words) - 1))


def ranks_problem(procs: int, command: Sequence[str]) -> str | None:
    """Why ``command`` cannot run as ``procs`` ranks per node (None when it can): the
    built-in node is one process per node, it does not join a torch.distributed group."""
    if procs > 1 and runs_builtin_node(command):
        return (
            f"procsPerNode {procs}: the built-in node ({' '.join(command)}) runs one process "
            "per node; give a command of your own (a script that uses torch.distributed) or "
            "procsPerNode 1"
        )
    return None


def mailbox_url(spec: GradientMailRunSpec, prefix: str) -> str:
    """The run's mailbox URL: the user's base location plus the run's own prefix."""
    box = spec.mailbox
    if box.url is not None:
        parts = urlsplit(box.url)
        path = "/".join(p for p in (parts.path.strip("/"), prefix) if p)
        return urlunsplit((parts.scheme, parts.netloc, "/" + path, parts.query, ""))
    query = {k: v for k, v in (("endpoint", box.endpoint), ("region", box.region)) if v}
    path = "/".join(p for p in (box.prefix.strip("/"), prefix) if p)
    tail = f"?{urlencode(query)}" if query else ""
    return f"s3://{box.bucket}/{path}{tail}"


_LEARNER_MAX = 128  # gradientmail.wire.check_learner_id


def learner_id(run: str, index: int) -> str:
    """Node ``index``'s learner id; stable across restarts, so a replaced node rejoins.

    ``{run}-node-{index}``; when that is over 128 characters (run names go up to 253), the
    run's name is cut and a hash of the whole name keeps the ids of different runs and
    nodes apart: ``{start of run}-{10 hex}-node-{index}``.
    """
    full = re.sub(r"[^A-Za-z0-9._-]", "-", f"{run}-node-{index}")
    if len(full) <= _LEARNER_MAX:
        return full
    tail = f"-{hashlib.sha256(run.encode()).hexdigest()[:10]}-node-{index}"
    head = re.sub(r"[^A-Za-z0-9._-]", "-", run)[: _LEARNER_MAX - len(tail)]
    return head + tail


def node_env(spec: GradientMailRunSpec, run: str, index: int, url: str) -> NodeEnv:
    """The environment contract of node ``index`` of run ``run`` (mailbox ``url``)."""
    algo = spec.algorithm
    compression = algo.compression
    # Every registry setting by the same name (the node's task: "" leaves its default).
    values: dict[str, Any] = {field: getattr(algo, field) for field in SETTING_FIELDS}
    values["task"] = algo.task or ""
    return NodeEnv(
        mailbox=url,
        learner_id=learner_id(run, index),
        node_index=index,
        nodes=spec.nodes,
        barriers=spec.parties(),
        algorithm=algo.name,
        compression="" if compression is None else compression_to_text(compression.settings()),
        lm=algo.lm or "",
        **values,
    )
