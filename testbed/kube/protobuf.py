"""Decoding the few protobuf request bodies real clients send, into the JSON the store takes.

kubectl's typed commands (``create configmap|secret|namespace|serviceaccount``) and helm's
release storage (Secrets) encode request bodies as Kubernetes protobuf: the magic ``k8s\\0`` and a
``runtime.Unknown`` envelope (apiVersion, kind, raw message). This module decodes ConfigMap,
Secret, Namespace, ServiceAccount and DeleteOptions, with the ObjectMeta fields that matter (name,
generateName, namespace, uid, resourceVersion, labels, annotations, ownerReferences,
finalizers); timestamps and managed fields are skipped, as the server sets them anyway. Any
other kind is :class:`ProtobufUnsupported` (HTTP 415). Responses are always JSON, which these
clients accept.

Field numbers are those of ``k8s.io/api/core/v1/generated.proto`` and
``k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MAGIC", "ProtobufUnsupported", "decode"]

Obj = dict[str, Any]
MAGIC = b"k8s\x00"


class ProtobufUnsupported(ValueError):
    """A protobuf body this module cannot decode (malformed, or a kind it does not know)."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufUnsupported("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtobufUnsupported("varint too long")


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) pairs: ints for varints, bytes for everything else."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise ProtobufUnsupported(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ProtobufUnsupported("truncated field")
        yield number, value


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise ProtobufUnsupported("expected a string field")
    return value.decode()


def _map_entry(value: int | bytes) -> tuple[str, bytes]:
    if not isinstance(value, bytes):
        raise ProtobufUnsupported("expected a map entry")
    key, item = "", b""
    for number, part in _fields(value):
        if number == 1:
            key = _text(part)
        elif number == 2 and isinstance(part, bytes):
            item = part
    return key, item


def _owner_reference(data: bytes) -> Obj:
    names = {1: "kind", 3: "name", 4: "uid", 5: "apiVersion"}
    flags = {6: "controller", 7: "blockOwnerDeletion"}
    ref: Obj = {}
    for number, value in _fields(data):
        if number in names:
            ref[names[number]] = _text(value)
        elif number in flags:
            ref[flags[number]] = bool(value)
    return ref


def _object_meta(data: bytes) -> Obj:
    strings = {1: "name", 2: "generateName", 3: "namespace", 5: "uid", 6: "resourceVersion"}
    meta: Obj = {}
    for number, value in _fields(data):
        if number in strings:
            meta[strings[number]] = _text(value)
        elif number in (11, 12):
            key, item = _map_entry(value)
            meta.setdefault("labels" if number == 11 else "annotations", {})[key] = item.decode()
        elif number == 13 and isinstance(value, bytes):
            meta.setdefault("ownerReferences", []).append(_owner_reference(value))
        elif number == 14:
            meta.setdefault("finalizers", []).append(_text(value))
    return meta


def _config_map(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 2:
            key, item = _map_entry(value)
            obj.setdefault("data", {})[key] = item.decode()
        elif number == 3:
            key, item = _map_entry(value)
            obj.setdefault("binaryData", {})[key] = base64.b64encode(item).decode()
        elif number == 4:
            obj["immutable"] = bool(value)
    return obj


def _secret(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 2:
            key, item = _map_entry(value)
            obj.setdefault("data", {})[key] = base64.b64encode(item).decode()
        elif number == 3:
            obj["type"] = _text(value)
        elif number == 4:
            key, item = _map_entry(value)
            obj.setdefault("stringData", {})[key] = item.decode()
        elif number == 5:
            obj["immutable"] = bool(value)
    return obj


def _namespace(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 2 and isinstance(value, bytes):
            finalizers = [_text(v) for n, v in _fields(value) if n == 1]
            obj["spec"] = {"finalizers": finalizers}
    return obj


def _service_account(data: bytes) -> Obj:
    obj: Obj = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            obj["metadata"] = _object_meta(value)
        elif number == 4:
            obj["automountServiceAccountToken"] = bool(value)
    return obj


def _delete_options(data: bytes) -> Obj:
    options: Obj = {}
    for number, value in _fields(data):
        if number == 1 and isinstance(value, int):
            options["gracePeriodSeconds"] = value
        elif number == 2 and isinstance(value, bytes):
            names = {1: "uid", 2: "resourceVersion"}
            options["preconditions"] = {names[n]: _text(v) for n, v in _fields(value) if n in names}
        elif number == 3:
            options["orphanDependents"] = bool(value)
        elif number == 4:
            options["propagationPolicy"] = _text(value)
        elif number == 5:
            options.setdefault("dryRun", []).append(_text(value))
    return options


_DECODERS: dict[tuple[str, str], Callable[[bytes], Obj]] = {
    ("v1", "ConfigMap"): _config_map,
    ("v1", "Secret"): _secret,
    ("v1", "Namespace"): _namespace,
    ("v1", "ServiceAccount"): _service_account,
    ("v1", "DeleteOptions"): _delete_options,
    ("meta.k8s.io/v1", "DeleteOptions"): _delete_options,
}


def decode(body: bytes) -> Obj:
    """A protobuf request body as a JSON object with ``apiVersion`` and ``kind``."""
    if not body.startswith(MAGIC):
        raise ProtobufUnsupported("not a Kubernetes protobuf body (no k8s\\0 magic)")
    api_version = kind = ""
    raw = b""
    for number, value in _fields(body[len(MAGIC) :]):
        if number == 1 and isinstance(value, bytes):
            for part_number, part in _fields(value):
                if part_number == 1:
                    api_version = _text(part)
                elif part_number == 2:
                    kind = _text(part)
        elif number == 2 and isinstance(value, bytes):
            raw = value
    decoder = _DECODERS.get((api_version, kind))
    if decoder is None:
        raise ProtobufUnsupported(
            f"protobuf bodies of {kind or 'unknown kind'} ({api_version}) are not supported: "
            "send JSON or YAML (kubectl apply -f) instead"
        )
    obj = decoder(raw)
    if kind != "DeleteOptions":
        obj = {"apiVersion": api_version, "kind": kind, **obj}
    return obj
