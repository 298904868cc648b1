"""Pure functions from a GradientMailRun to what should exist: the prefix, the pods.

No I/O here, so every decision is unit-tested without a cluster.
"""

from __future__ import annotations

import hashlib
from typing import Any

from gradientmail.launch.runspec import GROUP, KIND, VERSION, GradientMailRunSpec

# The derivations shared with ``gradientmail run`` live with the spec models.
from gradientmail.launch.runspec import learner_id as learner_id
from gradientmail.launch.runspec import mailbox_url as mailbox_url
from gradientmail.launch.runspec import node_env as node_env

LABEL_RUN = f"{GROUP}/run"
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


def pod_name(run: str, index: int) -> str:
    return f"{run}-node-{index}"


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


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
    container: dict[str, Any] = {
        "name": "node",
        "image": template.image,
        "command": list(template.command),
        "args": list(template.args),
        "env": env,
        "securityContext": dict(RESTRICTED_CONTAINER_SECURITY),
    }
    if template.image_pull_policy:
        container["imagePullPolicy"] = template.image_pull_policy
    if template.resources is not None:
        container["resources"] = template.resources.model_dump(by_alias=True, exclude_none=True)
    labels = {
        **(extra_labels or {}),
        **template.labels,
        "app.kubernetes.io/name": "gradientmail-node",
        LABEL_MANAGED: MANAGER,
        LABEL_RUN: run,
        LABEL_INDEX: str(index),
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the operator replaces failed pods, within maxRestarts
        "automountServiceAccountToken": False,
        "securityContext": dict(RESTRICTED_POD_SECURITY),
        "containers": [container],
    }
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in template.tolerations
        ]
    if template.service_account_name:
        pod_spec["serviceAccountName"] = template.service_account_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(run, index),
            "namespace": namespace,
            "labels": labels,
            "annotations": dict(template.annotations),
            "ownerReferences": [owner_reference(run, uid)],
        },
        "spec": pod_spec,
    }
