"""A small kopf operator for the emulator's end-to-end tests: ``SampleJob`` → pods.

Run with ``kopf run --standalone -n NAMESPACE tests/kube/sample_operator.py`` against a
kubeconfig (the CRD is ``tests/kube/sample_crd.yaml``). It exercises what the real operator
will: a create handler that creates child pods with owner references (``kopf.adopt``) through
the kubernetes client and patches status; an index over the children; a timer that keeps
``status.running/succeeded/failed/phase`` current (the CRD prints them as columns); events;
and a delete handler, which makes kopf hold its finalizer until the handler has run. The
delete handler records itself in a ConfigMap ``<name>-deleted`` that tests look for.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
import kubernetes

GROUP = "demo.gradientmail.dev"
VERSION = "v1"
PLURAL = "samplejobs"
LABEL = f"{GROUP}/samplejob"
FINALIZER = f"{GROUP}/finalizer"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    settings.networking.request_timeout = 30
    kubernetes.config.load_kube_config()


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api()


@kopf.on.create(GROUP, VERSION, PLURAL)
def create(
    spec: kopf.Spec, name: str, namespace: str, body: kopf.Body, patch: kopf.Patch, **_: Any
) -> dict[str, Any]:
    pods = int(spec.get("pods", 1))
    for index in range(pods):
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-{index}", "labels": {LABEL: name}},
            "spec": {
                "restartPolicy": "Never",
                "automountServiceAccountToken": False,
                "containers": [
                    {
                        "name": "work",
                        "image": "python:3.11-slim",
                        "command": list(spec.get("command") or ["true"]),
                        "env": [
                            *[dict(e) for e in spec.get("env") or []],
                            {"name": "SAMPLEJOB_INDEX", "value": str(index)},
                        ],
                    }
                ],
            },
        }
        kopf.adopt(pod, owner=body)
        try:
            _core().create_namespaced_pod(namespace, pod)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:  # a retried handler finds its pods already there
                raise
    patch.status["phase"] = "Running"
    kopf.info(body, reason="PodsCreated", message=f"created {pods} pods")
    return {"pods": pods}


@kopf.index("", "v1", "pods", labels={LABEL: kopf.PRESENT})
def pod_phases(
    namespace: str, name: str, labels: kopf.Labels, status: kopf.Status, **_: Any
) -> dict[tuple[str, str], tuple[str, str]]:
    return {(namespace, labels[LABEL]): (name, status.get("phase", "Pending"))}


@kopf.timer(GROUP, VERSION, PLURAL, interval=0.3)
def progress(
    name: str,
    namespace: str,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    body: kopf.Body,
    pod_phases: kopf.Index[tuple[str, str], tuple[str, str]],
    **_: Any,
) -> None:
    phases = [phase for _, phase in pod_phases.get((namespace, name), [])]
    wanted = int(spec.get("pods", 1))
    counts = {
        "running": phases.count("Running"),
        "succeeded": phases.count("Succeeded"),
        "failed": phases.count("Failed"),
    }
    if counts["failed"]:
        phase = "Failed"
    elif counts["succeeded"] >= wanted:
        phase = "Succeeded"
    else:
        phase = status.get("phase") or "Pending"
    counts_phase: dict[str, Any] = {**counts, "phase": phase}
    for key, value in counts_phase.items():
        if status.get(key) != value:
            patch.status[key] = value
    if phase != status.get("phase") and phase in ("Succeeded", "Failed"):
        kopf.info(body, reason=phase, message=f"{counts['succeeded']}/{wanted} pods succeeded")


@kopf.on.delete(GROUP, VERSION, PLURAL)
def delete(name: str, namespace: str, **_: Any) -> None:
    record = {"metadata": {"name": f"{name}-deleted"}, "data": {"samplejob": name}}
    try:
        _core().create_namespaced_config_map(namespace, record)
    except kubernetes.client.ApiException as exc:
        # 409: recorded by an earlier try; 403: the namespace itself is being deleted.
        if exc.status not in (403, 409):
            raise
