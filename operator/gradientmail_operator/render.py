"""Pure functions from a GradientMailRun to what should exist: the prefix, the pods.

No I/O here, so every decision is unit-tested without a cluster.

A run of ``spec.procsPerNode`` P > 1 gets pods whose container runs
``python -m gradientmail.launch.ranks --procs P -- COMMAND`` (the template's command; its
args stay args): the launcher ``gradientmail run`` uses too, starting P ranks with
torchrun's environment and the pod's one learner id. GPUs are the template's to ask for
(``resources`` ``nvidia.com/gpu``: P when given; the spec refuses another count).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from copy import deepcopy
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.launch.ranks import launcher_command
from gradientmail.launch.runspec import GROUP, KIND, VERSION, GradientMailRunSpec, ranks_problem

# The derivations shared with ``gradientmail run`` live with the spec models.
from gradientmail.launch.runspec import learner_id as learner_id
from gradientmail.launch.runspec import mailbox_url as mailbox_url
from gradientmail.launch.runspec import node_env as node_env

LABEL_RUN = f"{GROUP}/run"  # run_label(name): the name, or a hashed form when too long
ANNOTATION_RUN_NAME = f"{GROUP}/run-name"  # the run's full name, on every pod
LABEL_INDEX = f"{GROUP}/node-index"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGER = "gradientmail-operator"

RESTRICTED_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "fsGroup": 1000,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def run_prefix(namespace: str, name: str, uid: str) -> str:
    """A prefix unique to this run object: a re-created run with the same name gets a new
    one, and an operator restart derives the same one again."""
    digest = hashlib.sha256(uid.encode()).hexdigest()[:10]
    return f"{namespace}/{name}-{digest}"


_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
_LABEL_MAX = 63
_NAME_MAX = 253  # a DNS-1123 subdomain: pod names, and the run's own name


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:10]


def _cut(name: str, length: int) -> str:
    """The first ``length`` characters of ``name``, ending with a letter or digit."""
    return re.sub(r"[^A-Za-z0-9]+$", "", name[:length])


def run_label(name: str) -> str:
    """The value of the ``gradientmail.dev/run`` label for run ``name``.

    A run's name may be 253 characters, a label value only 63: a name that is a valid label
    value is used as it is; a longer one becomes its first 50 characters, ``-`` and 10 hex
    of its SHA-256 (stable, so an operator restart selects the same pods). The full name is
    in the pods' ``gradientmail.dev/run-name`` annotation.
    """
    if len(name) <= _LABEL_MAX and _LABEL_VALUE.fullmatch(name):
        return name
    safe = re.sub(r"[^-A-Za-z0-9_.]", "-", name)
    return f"{_cut(safe, 50)}-{_digest(name)}".lstrip("-")


def pod_name(run: str, index: int) -> str:
    """``{run}-node-{index}``; for a run name so long that this passes 253 characters, the
    name is cut and a hash of the whole name added (``{start}-{10 hex}-node-{index}``)."""
    name = f"{run}-node-{index}"
    if len(name) <= _NAME_MAX:
        return name
    tail = f"-{_digest(run)}-node-{index}"
    return _cut(run, _NAME_MAX - len(tail)) + tail


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    # No blockOwnerDeletion: with the OwnerReferencesPermissionEnforcement admission plugin
    # (OpenShift enables it) setting it needs update on gradientmailruns/finalizers, which the
    # operator's RBAC does not grant, and the pod would be refused. Garbage collection still
    # deletes the pods with the run; only foreground deletion no longer waits for them.
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
    }


def _under(path: str, mount_path: str) -> bool:
    mount_path = posixpath.normpath(mount_path)
    return mount_path == "/" or path == mount_path or path.startswith(mount_path + "/")


def launch_problems(spec: GradientMailRunSpec) -> list[str]:
    """What makes ``spec``'s pods unable to start their command as ``procsPerNode`` ranks
    (the built-in node is one process per node), wherever the pods run; empty when fit."""
    template = spec.template
    if spec.procs_per_node > 1 and not template.command:
        # The launcher becomes the container's command: the image's entrypoint would not run.
        return [
            f"template.command is empty and procsPerNode is {spec.procs_per_node}: the pod "
            "runs the ranks' launcher in place of the image's entrypoint; give the command "
            "the ranks run in template.command"
        ]
    problem = ranks_problem(spec.procs_per_node, [*template.command, *template.args])
    return [] if problem is None else [f"template.command: {problem}"]


def cluster_problems(spec: GradientMailRunSpec) -> list[str]:
    """What makes ``spec`` unfit for node pods on a cluster, though the model accepts it
    (``gradientmail run`` runs the same spec as local processes); empty when fit.

    A ``file://`` mailbox is one directory that every node pod must see: its path must lie
    under a volume mount (writable) whose volume is a persistentVolumeClaim, a ReadWriteMany
    claim shared by every node pod. Otherwise each pod would write its own directory and
    start its own one-node run, silently.
    """
    url = spec.mailbox.url
    if url is None or not url.startswith("file://"):
        return []
    parts = urlsplit(url)
    raw = unquote(parts.path)
    shared = (
        "On a cluster a file:// mailbox must be on a persistentVolumeClaim of a "
        "ReadWriteMany claim shared by every node pod, mounted in template.volumeMounts; "
        "otherwise each pod starts its own one-node run. Use an s3:// mailbox, or mount "
        "the claim."
    )
    if parts.netloc not in ("", "localhost") or not raw.startswith("/"):
        return [f"mailbox.url {url!r} does not name an absolute directory (file:///dir)"]
    path = posixpath.normpath(raw)
    mounts = [m for m in spec.template.volume_mounts or [] if _under(path, str(m["mountPath"]))]
    if not mounts:
        return [f"mailbox.url {url!r}: no volume is mounted at or above {path}. {shared}"]
    # The deepest mount is the one the path lies on.
    mount = max(mounts, key=lambda m: len(posixpath.normpath(str(m["mountPath"]))))
    volumes = {v["name"]: v for v in spec.template.volumes or []}
    volume = volumes.get(mount["name"], {})
    where = (
        f"mailbox.url {url!r} lies on the volume mount {mount['name']!r} at {mount['mountPath']}"
    )
    claim = volume.get("persistentVolumeClaim")
    if not isinstance(claim, dict):
        return [f"{where}, whose volume is not a persistentVolumeClaim. {shared}"]
    if mount.get("readOnly") is True or claim.get("readOnly") is True:
        return [f"{where}, which is read-only: nodes write the mailbox. {shared}"]
    return []


def pod_manifest(
    spec: GradientMailRunSpec,
    *,
    namespace: str,
    run: str,
    uid: str,
    index: int,
    url: str,
    extra_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    template = spec.template
    env: list[dict[str, Any]] = [
        {"name": k, "value": v} for k, v in node_env(spec, run, index, url).to_environ().items()
    ]
    secret = spec.mailbox.credentials_secret
    if secret is not None:
        # Credentials by reference only: they never appear in the pod spec or the status.
        for var, key in (
            ("AWS_ACCESS_KEY_ID", secret.access_key_id_key),
            ("AWS_SECRET_ACCESS_KEY", secret.secret_access_key_key),
        ):
            env.append(
                {"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key}}}
            )
    for user_var in template.env:
        env.append(user_var.model_dump(by_alias=True, exclude_none=True))
    # A security context given in the template replaces the restricted default as a whole
    # (no merging: what the user wrote is what the pod gets).
    container: dict[str, Any] = {
        "name": "node",
        "image": template.image,
        "command": (
            list(template.command)
            if spec.procs_per_node == 1
            else launcher_command(spec.procs_per_node, template.command)
        ),
        "args": list(template.args),
        "env": env,
        "securityContext": deepcopy(
            RESTRICTED_CONTAINER_SECURITY
            if template.security_context is None
            else template.security_context
        ),
    }
    if template.working_dir:
        container["workingDir"] = template.working_dir
    if template.env_from:
        container["envFrom"] = deepcopy(template.env_from)
    if template.image_pull_policy:
        container["imagePullPolicy"] = template.image_pull_policy
    if template.resources is not None:
        container["resources"] = template.resources.model_dump(by_alias=True, exclude_none=True)
    if template.volume_mounts:
        container["volumeMounts"] = deepcopy(template.volume_mounts)
    labels = {
        **(extra_labels or {}),
        **template.labels,
        "app.kubernetes.io/name": "gradientmail-node",
        LABEL_MANAGED: MANAGER,
        LABEL_RUN: run_label(run),
        LABEL_INDEX: str(index),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator replaces failed pods, within maxRestarts
        "automountServiceAccountToken": False,
        "securityContext": deepcopy(
            RESTRICTED_POD_SECURITY
            if template.pod_security_context is None
            else template.pod_security_context
        ),
        "containers": [container],
    }
    if template.volumes:
        pod_spec["volumes"] = deepcopy(template.volumes)
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in template.image_pull_secrets]
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.affinity:
        pod_spec["affinity"] = deepcopy(template.affinity)
    if template.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations
        ]
    if template.priority_class_name:
        pod_spec["priorityClassName"] = template.priority_class_name
    if template.runtime_class_name:
        pod_spec["runtimeClassName"] = template.runtime_class_name
    if template.service_account_name:
        pod_spec["serviceAccountName"] = template.service_account_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(run, index),
            "namespace": namespace,
            "labels": labels,
            "annotations": {**template.annotations, ANNOTATION_RUN_NAME: run},
            "ownerReferences": [owner_reference(run, uid)],
        },
        "spec": pod_spec,
    }
