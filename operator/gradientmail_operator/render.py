"""Pure functions from a GradientMailRun to what should exist: the prefix, the pods.

No I/O here, so every decision is unit-tested without a cluster.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from gradientmail.node import NodeEnv
from gradientmail.runspec import GROUP, KIND, VERSION, GradientMailRunSpec

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


def pod_name(run: str, index: int) -> str:
    return f"{run}-node-{index}"


def learner_id(run: str, index: int) -> str:
    # Stable across pod replacements: a replaced node rejoins as the same learner.
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{run}-node-{index}")[:128]


def node_env(spec: GradientMailRunSpec, run: str, index: int, url: str) -> NodeEnv:
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
    )


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
