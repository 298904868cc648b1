"""The three PATCH formats the API server accepts, as pure functions on JSON values.

* JSON merge patch (RFC 7386, ``application/merge-patch+json``): what kopf and kubectl send
  for custom resources.
* JSON patch (RFC 6902, ``application/json-patch+json``): kopf sends ``test`` ops on
  ``/metadata/resourceVersion``; a failed ``test`` is :class:`PatchTestFailed` (HTTP 422).
* Strategic merge patch (``application/strategic-merge-patch+json``), as kubectl sends it for
  built-in types: merge patch plus lists merged by key for the fields in :data:`MERGE_KEYS`,
  ``$patch: replace|delete``, ``$retainKeys``, ``$deleteFromPrimitiveList/…`` and
  ``$setElementOrder/…`` (honoured as far as reordering goes). The real server takes the merge
  keys from Go struct tags; here they are a table by field name, good for the core types.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "MERGE_KEYS",
    "PatchError",
    "PatchTestFailed",
    "json_patch",
    "merge_patch",
    "strategic_merge_patch",
]


class PatchError(ValueError):
    """A malformed patch or one that cannot apply (HTTP 422, or 400 when malformed)."""


class PatchTestFailed(PatchError):
    """A JSON-patch ``test`` operation did not match (HTTP 422)."""


MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "conditions": "type",
    "hostAliases": "ip",
    "ports": "containerPort",  # Service ports use "port": see _merge_key
    "topologySpreadConstraints": "topologyKey",
}
"""Field name → merge key of lists merged item by item in strategic merge patches."""

PRIMITIVE_MERGE_LISTS = frozenset({"finalizers"})
"""Lists of scalars that strategic merge patches union instead of replacing."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ---------------------------------------------------------------------------------------------
# RFC 6902


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}")
    return [_unescape(token) for token in path[1:].split("/")]


def _index(container: list[Any], token: str, *, allow_end: bool) -> int:
    if token == "-" and allow_end:
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"invalid list index {token!r}")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise PatchError(f"list index {index} out of range")
    return index


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for token in tokens[:-1]:
        if isinstance(node, dict):
            if token not in node:
                raise PatchError(f"path segment {token!r} does not exist")
            node = node[token]
        elif isinstance(node, list):
            node = node[_index(node, token, allow_end=False)]
        else:
            raise PatchError(f"path segment {token!r} is not inside a container")
    return node


def _get(doc: Any, tokens: list[str]) -> Any:
    if not tokens:
        return doc
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {'/'.join(tokens)!r} does not exist")
        return parent[last]
    if isinstance(parent, list):
        return parent[_index(parent, last, allow_end=False)]
    raise PatchError(f"path {'/'.join(tokens)!r} does not exist")


def _add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, allow_end=True), value)
    else:
        raise PatchError(f"cannot add at {'/'.join(tokens)!r}")
    return doc


def _remove(doc: Any, tokens: list[str]) -> Any:
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _parent(doc, tokens)
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"cannot remove missing path {'/'.join(tokens)!r}")
        del parent[last]
    elif isinstance(parent, list):
        del parent[_index(parent, last, allow_end=False)]
    else:
        raise PatchError(f"cannot remove at {'/'.join(tokens)!r}")
    return doc


def _replace(doc: Any, tokens: list[str], value: Any) -> Any:
    _get(doc, tokens)  # must exist
    if not tokens:
        return value
    parent = _parent(doc, tokens)
    if isinstance(parent, dict):
        parent[tokens[-1]] = value
    else:
        parent[_index(parent, tokens[-1], allow_end=False)] = value
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """Apply RFC 6902 operations to a deep copy of ``target``; atomic (all or nothing)."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"malformed JSON-patch operation {op!r}")
        kind, tokens = op["op"], _pointer(op["path"])
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"JSON-patch {kind!r} needs a value")
        if kind == "add":
            doc = _add(doc, tokens, copy.deepcopy(op["value"]))
        elif kind == "remove":
            doc = _remove(doc, tokens)
        elif kind == "replace":
            doc = _replace(doc, tokens, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            source = _pointer(op.get("from", ""))
            value = copy.deepcopy(_get(doc, source))
            if kind == "move":
                doc = _remove(doc, source)
            doc = _add(doc, tokens, value)
        elif kind == "test":
            try:
                actual = _get(doc, tokens)
            except PatchError as exc:
                raise PatchTestFailed(f"test failed: {op['path']} does not exist") from exc
            if actual != op["value"]:
                raise PatchTestFailed(
                    f"test failed: {op['path']} is {actual!r}, not {op['value']!r}"
                )
        else:
            raise PatchError(f"unknown JSON-patch operation {kind!r}")
    return doc


# ---------------------------------------------------------------------------------------------
# Strategic merge patch (approximate; see the module docstring)


def _merge_key(field: str, items: list[Any]) -> str | None:
    key = MERGE_KEYS.get(field)
    dicts = bool(items) and all(isinstance(i, dict) for i in items)
    if field == "ports" and dicts and not any("containerPort" in i for i in items):
        return "port" if any("port" in i for i in items) else key
    return key


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Apply a strategic merge patch to a deep copy of ``target``."""
    return _smp_map(copy.deepcopy(target) if isinstance(target, dict) else {}, patch)


def _smp_map(target: dict[str, Any], patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    retain = patch.get("$retainKeys")
    orders: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys"):
            continue
        if key.startswith("$setElementOrder/"):
            orders[key.split("/", 1)[1]] = value if isinstance(value, list) else []
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            current = target.get(field)
            if isinstance(current, list) and isinstance(value, list):
                target[field] = [item for item in current if item not in value]
            continue
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict):
            current = target.get(key)
            merged = _smp_map(current if isinstance(current, dict) else {}, value)
            if merged is None:
                target.pop(key, None)
            else:
                target[key] = merged
        elif isinstance(value, list):
            target[key] = _smp_list(key, target.get(key), value)
        else:
            target[key] = value
    for field, order in orders.items():
        if isinstance(target.get(field), list):
            target[field] = _reorder(field, target[field], order)
    if isinstance(retain, list):
        target = {k: v for k, v in target.items() if k in retain}
    return target


def _smp_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current_list = list(current) if isinstance(current, list) else []
    if any(isinstance(i, dict) and i.get("$patch") == "replace" for i in patch):
        return [
            copy.deepcopy(i)
            for i in patch
            if not (isinstance(i, dict) and i.get("$patch") == "replace")
        ]
    if field in PRIMITIVE_MERGE_LISTS and all(not isinstance(i, dict | list) for i in patch):
        return current_list + [i for i in patch if i not in current_list]
    key = _merge_key(field, patch)
    if key is None or not all(isinstance(i, dict) for i in patch):
        return copy.deepcopy(patch)
    result = [copy.deepcopy(i) for i in current_list]
    for item in patch:
        match = next(
            (
                n
                for n, old in enumerate(result)
                if isinstance(old, dict) and old.get(key) == item.get(key)
            ),
            None,
        )
        if item.get("$patch") == "delete":
            if match is not None:
                del result[match]
            continue
        if match is None:
            result.append(_smp_map({}, item))
        else:
            result[match] = _smp_map(result[match], item)
    return result


def _reorder(field: str, items: list[Any], order: list[Any]) -> list[Any]:
    """Order items as ``$setElementOrder`` says; items it does not name keep their place after."""
    key = MERGE_KEYS.get(field)

    def identity(item: Any) -> Any:
        if key is not None and isinstance(item, dict):
            return item.get(key)
        return item

    wanted = [identity(o) if isinstance(o, dict) else o for o in order]
    ranked = sorted(
        enumerate(items),
        key=lambda pair: (
            wanted.index(identity(pair[1])) if identity(pair[1]) in wanted else len(wanted),
            pair[0],
        ),
    )
    return [item for _, item in ranked]
