"""The controllers the emulator runs itself, as passes over the whole store: garbage
collection by ``ownerReferences`` (Background, Foreground and Orphan propagation), namespace
cleanup (contents first, then the namespace) and CRD cleanup (custom resources first, then
the CRD). ``Store.collect_garbage`` repeats passes until one changes nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from testbed.kube.errors import ApiError
from testbed.kube.resources import ResourceType

if TYPE_CHECKING:
    from testbed.kube.store import Store

__all__ = ["CRD_CLEANUP_FINALIZER", "FOREGROUND", "ORPHAN", "collect_pass"]

Obj = dict[str, Any]

CRD_CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"
FOREGROUND = "foregroundDeletion"
ORPHAN = "orphan"


def _meta(obj: Obj) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _deleting(obj: Obj) -> bool:
    return bool(_meta(obj).get("deletionTimestamp"))


def collect_pass(store: Store) -> bool:
    """One pass of every controller; True when it changed something."""
    changed = False
    everything = list(store.all_objects())
    live = {_meta(obj).get("uid") for _, obj in everything}
    dependents: dict[str, list[tuple[ResourceType, Obj]]] = {}
    for rt, obj in everything:
        for ref in _meta(obj).get("ownerReferences") or []:
            dependents.setdefault(ref.get("uid", ""), []).append((rt, obj))
    # Dangling owner references: drop them, or delete the object when no owner is left.
    for rt, obj in everything:
        refs = _meta(obj).get("ownerReferences") or []
        dangling = [ref for ref in refs if ref.get("uid") not in live]
        if not dangling or store.current(rt, obj) is None:
            continue
        if len(dangling) == len(refs):
            if not _deleting(obj):
                _delete(store, rt, obj)
                changed = True
        else:
            live_refs = [ref for ref in refs if ref.get("uid") in live]
            changed |= store.edit_metadata(rt, obj, _set_owner_references(live_refs))
    for rt, owner in everything:
        meta = _meta(owner)
        if not _deleting(owner) or store.current(rt, owner) is None:
            continue
        finalizers = meta.get("finalizers") or []
        children = [
            (crt, child)
            for crt, child in dependents.get(meta.get("uid", ""), [])
            if store.current(crt, child) is not None
        ]
        if ORPHAN in finalizers:
            uid = meta.get("uid")
            for crt, child in children:
                refs = _meta(child).get("ownerReferences") or []
                kept = [r for r in refs if r.get("uid") != uid]
                changed |= store.edit_metadata(crt, child, _set_owner_references(kept))
            changed |= _drop_finalizer(store, rt, owner, ORPHAN)
        elif FOREGROUND in finalizers:
            for crt, child in children:
                if not _deleting(child):
                    _delete(store, crt, child)
                    changed = True
            if not children:
                changed |= _drop_finalizer(store, rt, owner, FOREGROUND)
        if CRD_CLEANUP_FINALIZER in finalizers:
            changed |= _cleanup_crd(store, rt, owner)
        if rt.storage_key == ("", "namespaces"):
            changed |= _cleanup_namespace(store, rt, owner)
    return changed


def _set_owner_references(refs: list[Obj]) -> Callable[[Obj], None]:
    def change(meta: Obj) -> None:
        meta["ownerReferences"] = refs

    return change


def _delete(store: Store, rt: ResourceType, obj: Obj) -> None:
    meta = _meta(obj)
    with contextlib.suppress(ApiError):
        store.delete(rt, meta.get("namespace"), meta["name"], {"propagationPolicy": "Background"})


def _drop_finalizer(store: Store, rt: ResourceType, obj: Obj, finalizer: str) -> bool:
    def change(meta: Obj) -> None:
        meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != finalizer]

    return store.edit_metadata(rt, obj, change)


def _cleanup_crd(store: Store, rt: ResourceType, crd: Obj) -> bool:
    spec = crd.get("spec") or {}
    key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
    instance_type = store.storage_type(key)
    instances = store.objects_of(key)
    changed = False
    if instance_type is not None:
        for obj in instances:
            if not _deleting(obj):
                _delete(store, instance_type, obj)
                changed = True
    if not instances:
        changed |= _drop_finalizer(store, rt, crd, CRD_CLEANUP_FINALIZER)
    return changed


def _cleanup_namespace(store: Store, rt: ResourceType, namespace: Obj) -> bool:
    name = _meta(namespace).get("name")
    contents = [
        (crt, obj)
        for crt, obj in store.all_objects()
        if crt.namespaced and _meta(obj).get("namespace") == name
    ]
    changed = False
    for crt, obj in contents:
        if not _deleting(obj):
            _delete(store, crt, obj)
            changed = True
    if not contents:
        changed |= store.edit(rt, namespace, _clear_namespace_finalizers)
    return changed


def _clear_namespace_finalizers(namespace: Obj) -> None:
    """What the namespace controller's ``/finalize`` call does once the namespace is empty."""
    namespace.setdefault("spec", {})["finalizers"] = []
