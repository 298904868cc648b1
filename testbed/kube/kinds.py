"""Per-type behaviour of the API server: kind checks, metadata validation, the defaults and
server-set fields of particular built-in types, and what ``generation`` follows."""

from __future__ import annotations

import base64
import datetime
import re
from typing import Any

from testbed.kube.errors import bad_request, invalid
from testbed.kube.resources import CrdError, ResourceType, crd_types

__all__ = ["apply_defaults", "check_kind", "has_generation", "now_rfc3339", "spec_part", "validate"]

Obj = dict[str, Any]

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def now_rfc3339(offset_s: float = 0.0) -> str:
    moment = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _meta(obj: Obj) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def has_generation(rt: ResourceType) -> bool:
    """Custom resources and built-ins with a spec and status keep ``metadata.generation``."""
    return rt.custom or ("status" in rt.subresources and rt.plural not in ("namespaces", "nodes"))


def check_kind(rt: ResourceType, body: Obj) -> None:
    kind, api_version = body.get("kind"), body.get("apiVersion")
    if kind and kind != rt.kind:
        raise bad_request(f"the kind of the object ({kind}) does not match the request ({rt.kind})")
    if api_version and api_version.split("/")[0] != (rt.group or api_version):
        raise bad_request(
            f"the API version of the object ({api_version}) does not match the request "
            f"({rt.api_version})"
        )


def spec_part(rt: ResourceType, obj: Obj) -> Obj:
    """What ``generation`` follows: all but metadata (and status with a subresource)."""
    skip = {"metadata", "apiVersion", "kind"}
    if "status" in rt.subresources:
        skip.add("status")
    return {k: v for k, v in obj.items() if k not in skip}


def validate(rt: ResourceType, obj: Obj) -> None:
    """Metadata checks the real server makes too (names, labels, owner references)."""
    meta = obj["metadata"]
    name = meta.get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not _NAME_RE.match(name):
        raise invalid(
            rt,
            str(name),
            f"metadata.name: Invalid value: {name!r}: a lowercase RFC 1123 subdomain "
            "must consist of lower case alphanumeric characters, '-' or '.'",
        )
    for field in ("labels", "annotations"):
        values = meta.get(field)
        if values is None:
            continue
        if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
            raise invalid(rt, name, f"metadata.{field}: values must be strings")
    for key, value in (meta.get("labels") or {}).items():
        label_name = key.rsplit("/", 1)[-1]
        if len(label_name) > 63 or not _LABEL_NAME_RE.match(label_name):
            raise invalid(
                rt,
                name,
                f"metadata.labels: Invalid value: {key!r}: name part must be a valid label name",
            )
        if len(value) > 63 or not _LABEL_VALUE_RE.match(value):
            raise invalid(
                rt,
                name,
                f"metadata.labels: Invalid value: {value!r}: a valid label must be an "
                "empty string or consist of alphanumeric characters, '-', '_' or '.'",
            )
    for ref in meta.get("ownerReferences") or []:
        if not isinstance(ref, dict) or not all(
            ref.get(k) for k in ("apiVersion", "kind", "name", "uid")
        ):
            raise invalid(
                rt,
                name,
                f"metadata.ownerReferences: apiVersion, kind, name and uid are required: {ref!r}",
            )
    finalizers = meta.get("finalizers")
    if finalizers is not None and not (
        isinstance(finalizers, list) and all(isinstance(f, str) for f in finalizers)
    ):
        raise invalid(rt, name, "metadata.finalizers must be a list of strings")


def apply_defaults(rt: ResourceType, obj: Obj, old: Obj | None) -> None:
    """Defaults and server-set fields of particular types (create: ``old`` is None)."""
    key = rt.storage_key
    if key == ("", "secrets"):
        string_data = obj.pop("stringData", None) or {}
        data = dict(obj.get("data") or {})
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()
        if data:
            obj["data"] = data
        if not obj.get("type"):
            obj["type"] = "Opaque"
    elif key == ("", "pods") and old is None:
        spec = obj.setdefault("spec", {})
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("schedulerName", "default-scheduler")
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
    elif key == ("", "namespaces"):
        if old is None:
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
        meta = obj["metadata"]
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
    elif key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        try:
            types = crd_types(obj)
        except (CrdError, KeyError, TypeError, ValueError) as exc:
            raise invalid(rt, _meta(obj).get("name", ""), str(exc)) from exc
        names = dict(obj["spec"]["names"])
        names.setdefault("singular", types[0].singular)
        names.setdefault("listKind", f"{names['kind']}List")
        condition_time = (
            ((old or {}).get("status") or {})
            .get("conditions", [{}])[0]
            .get("lastTransitionTime", now_rfc3339())
        )
        obj["status"] = {
            "acceptedNames": names,
            "conditions": [
                {
                    "type": "NamesAccepted",
                    "status": "True",
                    "reason": "NoConflicts",
                    "message": "no conflicts found",
                    "lastTransitionTime": condition_time,
                },
                {
                    "type": "Established",
                    "status": "True",
                    "reason": "InitialNamesAccepted",
                    "message": "the initial names have been accepted",
                    "lastTransitionTime": condition_time,
                },
            ],
            "storedVersions": [v["name"] for v in obj["spec"]["versions"] if v.get("storage")],
        }
