"""The GradientMailRun spec, as pydantic models: the single source of the CRD schema.

The operator's ``crd.py`` renders :class:`GradientMailRunSpec` into the CRD's
``openAPIV3Schema``; the operator parses every resource it sees with the same models, and
so does ``gradientmail run -f run.yaml``: a spec the CRD accepts is a spec both understand,
and an unknown field is refused by name.

The pure derivations from a spec to what a node sees (:func:`mailbox_url`,
:func:`learner_id`, :func:`node_env`) live here too, so the operator's pods and
``gradientmail run``'s local processes get the same environment.
"""

from __future__ import annotations

import hashlib
import re
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

from gradientmail.launch.env import MAX_GRID_DIMS, MAX_GROUP_SIZE, NodeEnv

GROUP = "gradientmail.dev"
VERSION = "v1alpha1"
KIND = "GradientMailRun"
PLURAL = "gradientmailruns"
SINGULAR = "gradientmailrun"
SHORT_NAMES = ["gmr"]

DEFAULT_IMAGE = "ghcr.io/gradientmail/node:0.1.0"
DEFAULT_COMMAND = ["python", "-m", "gradientmail.node"]

_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", alias_generator=_camel, populate_by_name=True, frozen=True
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
    """What each node pod runs. Defaults run the built-in node (``gradientmail.node``)."""

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
            if var.name.startswith("GRADIENTMAIL_"):
                raise ValueError(
                    f"env {var.name}: GRADIENTMAIL_* variables are set by the operator"
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


# The settings of one algorithm only: under the other one they are refused by name unless
# they keep their default (so a resource written out with every default, as
# `gradientmail run` writes run.yaml and the API server fills in the CRD's defaults, is
# still accepted).
DILOCO_ONLY = ("fragments", "outer_lr", "outer_momentum", "quorum")
MOSHPIT_ONLY = ("group_size", "grid_dims")


class AlgorithmSpec(_Model):
    """The algorithm (name: diloco or moshpit) and the Session settings of every node."""

    # One line, `algorithm: {name: moshpit}`, turns a run into Moshpit SGD on a 4 x 4 grid.
    # A setting of the other algorithm (fragments under Moshpit, groupSize under DiLoCo,
    # ...) is refused by name unless it keeps its default.

    name: Literal["diloco", "moshpit"] = Field(
        default="diloco",
        description=(
            "The algorithm: diloco (every learner averages with every other at each sync "
            "point) or moshpit (small groups on a virtual grid of groupSize ** gridDims "
            "cells average at each sync point)."
        ),
    )
    sync_every: int = Field(default=100, ge=1, description="Local steps between syncs.")
    fragments: int = Field(
        default=1, ge=1, description="DiLoCo only: streaming fragments (Moshpit: 1)."
    )
    outer_lr: float = Field(default=0.7, gt=0, description="DiLoCo only: outer learning rate.")
    outer_momentum: float = Field(
        default=0.9, ge=0, lt=1, description="DiLoCo only: outer Nesterov momentum."
    )
    quorum: int = Field(
        default=1,
        ge=1,
        description="DiLoCo only: contributions a round may close with after roundTimeout.",
    )
    round_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a round (a group round, for Moshpit) waits for the missing.",
    )
    steps: int = Field(default=200, ge=1, description="Steps of the built-in node.")
    group_size: int = Field(
        default=4,
        ge=2,
        le=MAX_GROUP_SIZE,
        description="Moshpit only: the grid's side, the members of a full group.",
    )
    grid_dims: int = Field(
        default=2,
        ge=1,
        le=MAX_GRID_DIMS,
        description=(
            "Moshpit only: the grid's dimensions; gridDims rounds average every learner of "
            "a full grid (groupSize ** gridDims learners) with every other."
        ),
    )

    @field_validator(*DILOCO_ONLY, *MOSHPIT_ONLY)
    @classmethod
    def _of_this_algorithm(cls, value: Any, info: ValidationInfo) -> Any:
        # ``name`` is declared first, so it is validated before these (when it failed, only
        # its own error is reported).
        name = info.data.get("name")
        if name is None:
            return value
        field = info.field_name
        assert field is not None
        own = "diloco" if field in DILOCO_ONLY else "moshpit"
        default = cls.model_fields[field].default
        if name != own and value != default:
            if own == "diloco":
                raise ValueError(
                    "a DiLoCo setting, and this run is Moshpit (algorithm.name: moshpit), "
                    f"which averages whole models in groups; leave it out (or at {default!r}), "
                    "or set algorithm.name: diloco"
                )
            raise ValueError(
                "a Moshpit setting, and this run is DiLoCo; set algorithm.name: moshpit to "
                "run Moshpit, or leave it out"
            )
        return value

    @model_validator(mode="after")
    def _fragments_fit(self) -> AlgorithmSpec:
        if self.fragments > self.sync_every:
            raise ValueError("algorithm.fragments cannot exceed algorithm.syncEvery")
        return self


class GradientMailRunSpec(_Model):
    """A training run: ``nodes`` pods that meet only in the mailbox."""

    nodes: int = Field(ge=1, le=1000, description="Node pods to run.")
    template: PodTemplate = Field(default_factory=PodTemplate)
    mailbox: MailboxSpec
    barriers: dict[str, Annotated[int, Field(ge=1)]] = Field(
        default_factory=dict, description="Barrier name → parties (default parties = nodes)."
    )
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
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

    def parties(self) -> dict[str, int]:
        """Every barrier the built-in node uses, with its parties (default: all nodes)."""
        return {"start": self.nodes, "done": self.nodes} | dict(self.barriers)


# -- from a spec to what each node sees (the operator and ``gradientmail run``) -------------


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
    return NodeEnv(
        mailbox=url,
        learner_id=learner_id(run, index),
        node_index=index,
        nodes=spec.nodes,
        barriers=spec.parties(),
        sync_every=algo.sync_every,
        fragments=algo.fragments,
        outer_lr=algo.outer_lr,
        outer_momentum=algo.outer_momentum,
        quorum=algo.quorum,
        round_timeout=algo.round_timeout,
        steps=algo.steps,
        algorithm=algo.name,
        group_size=algo.group_size,
        grid_dims=algo.grid_dims,
    )
