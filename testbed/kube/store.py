"""The emulated cluster state: objects, resource versions, watch history, deletion, and CRD
registration; the controllers the API server stands in for (garbage collection, namespace
and CRD cleanup) run from here after writes, as passes in ``gc.py``.

Everything here is synchronous and runs on the API server's event loop, so each call is
atomic: a list and the resource version it reports can never miss a write, and a watch that
starts from that version replays exactly the events after it.

Semantics (each proven in ``tests/kube/test_apiserver.py``):

* one cluster-wide ``resourceVersion`` counter; every write that changes an object takes the
  next value; a write that changes nothing (a no-op patch) keeps the old one and emits nothing;
* ``uid`` and ``creationTimestamp`` are set by the server, and ``generation`` for custom
  resources and built-ins with a spec and a status (not config maps, secrets, ...); it grows
  when anything but metadata (and status, for types with a status subresource) changes, and
  when the deletion timestamp is set;
* a write whose body carries a ``resourceVersion`` other than the current one is a 409
  Conflict; PUT without one is refused for custom resources (422), as the real server does;
* for types with a ``status`` subresource, writes to the object ignore ``status`` and writes
  to ``/status`` ignore everything else; ``status`` sent on create is dropped;
* delete sets ``deletionTimestamp`` while finalizers remain (no new finalizer may be added
  then), and removes the object when the last one goes; ``propagationPolicy`` Foreground and
  Orphan add the ``foregroundDeletion`` / ``orphan`` finalizers and are honoured; Background
  (the default) deletes dependents after the owner is gone;
* a pod bound to a node (``spec.nodeName``) that has not finished is deleted gracefully: it
  keeps a deletion timestamp until the kubelet confirms with ``gracePeriodSeconds=0``;
* garbage collection (``gc.py``): an object whose owners (``ownerReferences`` by uid) are
  all gone is deleted; a dangling reference beside live owners is removed;
* deleting a namespace deletes its contents and then the namespace; deleting a CRD deletes
  its custom resources and then the CRD; creating in a missing (404) or terminating (403)
  namespace is refused;
* a CRD registers its types (discovery, scope, subresources, printer columns, short names)
  when written, and gets ``NamesAccepted`` and ``Established`` conditions at once.
"""

from __future__ import annotations

import base64
import copy
import json
import random
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from testbed.kube.errors import ApiError, bad_request, conflict, details, invalid, not_found
from testbed.kube.gc import CRD_CLEANUP_FINALIZER, FOREGROUND, ORPHAN, collect_pass
from testbed.kube.kinds import (
    apply_defaults,
    check_kind,
    has_generation,
    now_rfc3339,
    spec_part,
    validate,
)
from testbed.kube.patches import (
    PatchError,
    PatchTestFailed,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from testbed.kube.resources import BUILTIN_TYPES, ResourceType, crd_types
from testbed.kube.selectors import FieldSelector, LabelSelector

__all__ = ["ApiError", "Store", "WatchEvent"]

Obj = dict[str, Any]

INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_SERVER_META = (
    "name",
    "namespace",
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
)
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GC_PASSES = 100


@dataclass(frozen=True)
class WatchEvent:
    """One change, as watches see it; ``old`` is the state before (None for ADDED)."""

    rv: int
    type: str
    key: tuple[str, str]
    obj: Obj
    old: Obj | None


def _meta(obj: Obj) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _deleting(obj: Obj) -> bool:
    return bool(_meta(obj).get("deletionTimestamp"))


def _sort_key(obj: Obj) -> tuple[str, str]:
    meta = _meta(obj)
    return (meta.get("namespace", ""), meta.get("name", ""))


class Store:
    """All objects of the emulated cluster, keyed by (group, plural) then (namespace, name).

    ``schedule`` runs a callback soon on the owning loop (garbage collection runs that way,
    after the write that caused it has been answered); None runs it at once.
    """

    def __init__(
        self,
        *,
        history_size: int = 10_000,
        schedule: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._storage_type: dict[tuple[str, str], ResourceType] = {}
        self._objects: dict[tuple[str, str], dict[tuple[str, str], Obj]] = {}
        self._rv = 0
        self._history: deque[WatchEvent] = deque(maxlen=history_size)
        self._evicted_rv = 0
        self._subscribers: list[Callable[[WatchEvent], None]] = []
        self._schedule = schedule
        self._gc_pending = False
        for rt in BUILTIN_TYPES:
            self._register(rt)
        for name in INITIAL_NAMESPACES:
            self.create(self.resolve("", "v1", "namespaces"), None, {"metadata": {"name": name}})

    # -- types -----------------------------------------------------------------------------

    def _register(self, rt: ResourceType) -> None:
        self._types[(rt.group, rt.version, rt.plural)] = rt
        if rt.preferred or rt.storage_key not in self._storage_type:
            self._storage_type[rt.storage_key] = rt
        self._objects.setdefault(rt.storage_key, {})

    def _unregister(self, group: str, plural: str) -> None:
        for key in [k for k in self._types if (k[0], k[2]) == (group, plural)]:
            del self._types[key]
        self._storage_type.pop((group, plural), None)
        self._objects.pop((group, plural), None)

    def types(self) -> list[ResourceType]:
        return list(self._types.values())

    def resolve(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self._types.get((group, version, plural))
        if rt is None:
            gv = f"{group}/{version}" if group else version
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({plural} in {gv})",
            )
        return rt

    # -- reading ---------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._objects.get(rt.storage_key, {}).get((namespace or "", name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def find(self, rt: ResourceType, namespace: str | None, name: str) -> Obj | None:
        return self._objects.get(rt.storage_key, {}).get((namespace or "", name))

    def list_objects(
        self,
        rt: ResourceType,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        *,
        limit: int = 0,
        continue_token: str = "",
    ) -> tuple[list[Obj], int, str]:
        """Matching objects sorted by (namespace, name), the list's version, the next token."""
        rv = self._rv
        start: tuple[str, str] | None = None
        if continue_token:
            try:
                token = json.loads(base64.urlsafe_b64decode(continue_token.encode()))
                start = (str(token["start"][0]), str(token["start"][1]))
                rv = int(token["rv"])
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                raise bad_request(f"invalid continue token: {exc}") from exc
        items = sorted(
            (
                obj
                for (ns, _), obj in self._objects.get(rt.storage_key, {}).items()
                if (namespace is None or ns == namespace)
                and labels.matches(_meta(obj).get("labels"))
                and fields.matches(obj)
            ),
            key=_sort_key,
        )
        if start is not None:
            items = [obj for obj in items if _sort_key(obj) > start]
        next_token = ""
        if limit > 0 and len(items) > limit:
            items = items[:limit]
            last = _sort_key(items[-1])
            next_token = base64.urlsafe_b64encode(
                json.dumps({"rv": rv, "start": list(last)}).encode()
            ).decode()
        return items, rv, next_token

    def all_objects(self) -> Iterator[tuple[ResourceType, Obj]]:
        for key, objects in list(self._objects.items()):
            rt = self._storage_type.get(key)
            if rt is not None:
                for obj in list(objects.values()):
                    yield rt, obj

    def current(self, rt: ResourceType, obj: Obj) -> Obj | None:
        """The stored version of ``obj`` if it still exists (same uid), else None."""
        meta = _meta(obj)
        current = self.find(rt, meta.get("namespace"), meta.get("name", ""))
        if current is None or _meta(current).get("uid") != meta.get("uid"):
            return None
        return current

    def storage_type(self, key: tuple[str, str]) -> ResourceType | None:
        return self._storage_type.get(key)

    def objects_of(self, key: tuple[str, str]) -> list[Obj]:
        return list(self._objects.get(key, {}).values())

    def edit(self, rt: ResourceType, obj: Obj, change: Callable[[Obj], None]) -> bool:
        """Controllers' writes: apply ``change`` to a copy of the current object and store it
        (no admission, no status isolation); False when gone or unchanged."""
        current = self.current(rt, obj)
        if current is None:
            return False
        new = copy.deepcopy(current)
        change(new)
        if new == current:
            return False
        self._store(rt, current, new)
        return True

    def edit_metadata(
        self, rt: ResourceType, obj: Obj, change: Callable[[dict[str, Any]], None]
    ) -> bool:
        return self.edit(rt, obj, lambda new: change(new["metadata"]))

    # -- watching --------------------------------------------------------------------------

    def subscribe(self, callback: Callable[[WatchEvent], None]) -> Callable[[], None]:
        """Call ``callback`` with every event from now on; returns the unsubscriber."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def events_since(self, rv: int) -> list[WatchEvent] | None:
        """Events after ``rv``, or None when some of them were already evicted (410 Gone)."""
        if rv < self._evicted_rv:
            return None
        found: list[WatchEvent] = []
        for event in reversed(self._history):
            if event.rv <= rv:
                break
            found.append(event)
        found.reverse()
        return found

    def _emit(self, kind: str, key: tuple[str, str], obj: Obj, old: Obj | None) -> None:
        if len(self._history) == self._history.maxlen:
            self._evicted_rv = self._history[0].rv
        event = WatchEvent(self._rv, kind, key, obj, old)
        self._history.append(event)
        for callback in list(self._subscribers):
            callback(event)

    # -- writing ---------------------------------------------------------------------------

    def create(
        self, rt: ResourceType, namespace: str | None, body: Any, *, dry_run: bool = False
    ) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        check_kind(rt, body)
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if rt.namespaced:
            if namespace is None:
                raise ApiError(
                    405,
                    "MethodNotAllowed",
                    "the server does not allow this method on the requested resource",
                )
            if meta.get("namespace") not in (None, "", namespace):
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on "
                    "the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        given = meta.get("name")
        if given is not None and not isinstance(given, str):
            raise invalid(rt, str(given), "metadata.name must be a string")
        name: str = given or ""
        if not name:
            prefix = meta.get("generateName")
            if not prefix:
                raise invalid(
                    rt, "", "metadata.name: Required value: name or generateName is required"
                )
            for _ in range(100):
                name = str(prefix) + "".join(random.choices(_GENERATE_ALPHABET, k=5))
                if self.find(rt, namespace, name) is None:
                    break
            meta["name"] = name
        if rt.namespaced:
            self._check_namespace_open(namespace or "")
        if self.find(rt, namespace, name) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{rt.group_resource} "{name}" already exists',
                details(rt, name),
            )
        for key in (*_SERVER_META[2:], "selfLink", "managedFields"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        if has_generation(rt):
            meta["generation"] = 1
        if "status" in rt.subresources:
            obj.pop("status", None)
        apply_defaults(rt, obj, None)
        validate(rt, obj)
        if dry_run:
            meta["resourceVersion"] = str(self._rv)
            return obj
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        self._objects[rt.storage_key][(namespace or "", name)] = obj
        self._emit("ADDED", rt.storage_key, obj, None)
        self._after_write(rt, obj)
        return obj

    def replace(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> Obj:
        """PUT: the body replaces the object (or its status, for ``subresource="status"``)."""
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        check_kind(rt, body)
        meta = _meta(body)
        if meta.get("name") not in (None, name):
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the "
                f"URL ({name})"
            )
        if rt.namespaced and meta.get("namespace") not in (None, "", namespace):
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on "
                "the request"
            )
        if rt.custom and not meta.get("resourceVersion"):
            raise invalid(
                rt,
                name,
                "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update",
            )
        return self._update(
            rt, namespace, name, lambda _old: copy.deepcopy(body), subresource, dry_run
        )

    def patch(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> Obj:
        """PATCH with a JSON, merge, strategic-merge or apply (treated as merge) patch."""
        kind = content_type.split(";")[0].strip().lower()
        if kind == "application/json-patch+json":
            apply: Callable[[Obj], Any] = lambda old: json_patch(old, patch)  # noqa: E731
        elif kind == "application/merge-patch+json":
            apply = lambda old: merge_patch(old, patch)  # noqa: E731
        elif kind == "application/strategic-merge-patch+json":
            if rt.custom:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    "the body of the request was in an unknown format - accepted media types "
                    "include: application/json-patch+json, application/merge-patch+json, "
                    "application/apply-patch+yaml",
                )
            apply = lambda old: strategic_merge_patch(old, patch)  # noqa: E731
        elif kind == "application/apply-patch+yaml":
            if not isinstance(patch, dict):
                raise bad_request("an apply patch must be an object")
            if self.find(rt, namespace, name) is None:
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = name
                return self.create(rt, namespace, body, dry_run=dry_run)
            apply = lambda old: merge_patch(old, patch)  # noqa: E731
        else:
            raise ApiError(415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}")
        if kind != "application/json-patch+json" and not isinstance(patch, dict):
            raise bad_request(f"a {kind} patch must be a JSON object")
        return self._update(rt, namespace, name, apply, subresource, dry_run)

    def bind(self, namespace: str, name: str, node: str) -> Obj:
        """``pods/binding``: set ``spec.nodeName`` once (409 if already bound)."""
        rt = self.resolve("", "v1", "pods")

        def assign(old: Obj) -> Obj:
            if (old.get("spec") or {}).get("nodeName"):
                raise conflict(
                    rt, name, f"pod {name} is already assigned to node {old['spec']['nodeName']!r}"
                )
            new = copy.deepcopy(old)
            new.setdefault("spec", {})["nodeName"] = node
            return new

        return self._update(rt, namespace, name, assign, None, False)

    def _update(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        compute: Callable[[Obj], Any],
        subresource: str | None,
        dry_run: bool,
    ) -> Obj:
        old = self.get(rt, namespace, name)
        try:
            new = compute(old)
        except PatchTestFailed as exc:
            raise invalid(rt, name, str(exc)) from exc
        except PatchError as exc:
            raise invalid(rt, name, f"the patch cannot be applied: {exc}") from exc
        if not isinstance(new, dict):
            raise invalid(rt, name, "the patched object is not a JSON object")
        wanted_uid = _meta(new).get("uid")
        if wanted_uid and wanted_uid != _meta(old).get("uid"):
            raise conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {wanted_uid}, "
                f"UID in object meta: {_meta(old).get('uid')}",
            )
        wanted_rv = _meta(new).get("resourceVersion")
        if wanted_rv and wanted_rv != _meta(old).get("resourceVersion"):
            raise conflict(
                rt,
                name,
                "the object has been modified; please apply your changes to the latest "
                "version and try again",
            )
        return self._commit(rt, old, new, subresource, dry_run)

    def _commit(
        self, rt: ResourceType, old: Obj, new: Obj, subresource: str | None, dry_run: bool = False
    ) -> Obj:
        """Turn a client's version of ``old`` into the stored one; store it unless a no-op."""
        new = copy.deepcopy(new)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if not isinstance(new.get("metadata"), dict):
            new["metadata"] = {}
        meta, old_meta = new["metadata"], _meta(old)
        for key in _SERVER_META:
            if key in old_meta:
                meta[key] = old_meta[key]
            else:
                meta.pop(key, None)
        meta.pop("selfLink", None)
        meta.pop("managedFields", None)
        if "status" in rt.subresources:
            if subresource == "status":
                status = new.get("status")
                new = copy.deepcopy(old)
                meta = new["metadata"]
                if status is None:
                    new.pop("status", None)
                else:
                    new["status"] = status
            elif "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        apply_defaults(rt, new, old)
        validate(rt, new)
        if _deleting(old):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise ApiError(
                    422,
                    "Invalid",
                    f'{rt.kind} "{meta["name"]}" is invalid: metadata.finalizers: Forbidden: '
                    f"no new finalizers can be added if the object is being deleted, found "
                    f"new finalizers {sorted(added)!r}",
                    details(rt, meta["name"]),
                )
        if has_generation(rt) and spec_part(rt, new) != spec_part(rt, old):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if new == old:
            return old
        if dry_run:
            return new
        return self._store(rt, old, new)

    def _store(self, rt: ResourceType, old: Obj, new: Obj) -> Obj:
        """Write ``new`` in place of ``old`` with the next version; remove it if it is done."""
        meta = new["metadata"]
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        key = (meta.get("namespace", ""), meta["name"])
        if _deleting(new) and self._may_vanish(rt, new):
            del self._objects[rt.storage_key][key]
            self._emit("DELETED", rt.storage_key, new, old)
            self._after_removal(rt, new)
        else:
            self._objects[rt.storage_key][key] = new
            self._emit("MODIFIED", rt.storage_key, new, old)
            self._after_write(rt, new)
        return new

    @staticmethod
    def _may_vanish(rt: ResourceType, obj: Obj) -> bool:
        meta = _meta(obj)
        if meta.get("finalizers"):
            return False
        if meta.get("deletionGracePeriodSeconds"):
            return False  # a running pod: the kubelet confirms with gracePeriodSeconds=0
        return not (rt.plural == "namespaces" and (obj.get("spec") or {}).get("finalizers"))

    def delete(
        self,
        rt: ResourceType,
        namespace: str | None,
        name: str,
        options: Obj | None = None,
        *,
        dry_run: bool = False,
    ) -> Obj:
        """DELETE with ``DeleteOptions`` (propagationPolicy, gracePeriodSeconds, preconditions)."""
        options = options or {}
        old = self.get(rt, namespace, name)
        old_meta = _meta(old)
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != old_meta.get("uid"):
            raise conflict(
                rt,
                name,
                f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                f"UID in object meta: {old_meta.get('uid')}",
            )
        if preconditions.get("resourceVersion") and preconditions[
            "resourceVersion"
        ] != old_meta.get("resourceVersion"):
            raise conflict(rt, name, "Precondition failed: resourceVersion does not match")
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is True:
            policy = "Orphan"
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise bad_request(f"unsupported propagationPolicy {policy!r}")
        grace = options.get("gracePeriodSeconds")
        new = copy.deepcopy(old)
        meta = new["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        wanted = {"Foreground": FOREGROUND, "Orphan": ORPHAN}.get(policy or "")
        if wanted and wanted not in finalizers:
            finalizers.append(wanted)
        if rt.storage_key == (
            "apiextensions.k8s.io",
            "customresourcedefinitions",
        ) and not _deleting(old):
            finalizers.append(CRD_CLEANUP_FINALIZER)
        if finalizers:
            meta["finalizers"] = finalizers
        if _deleting(old):
            if grace == 0 and meta.get("deletionGracePeriodSeconds"):
                meta["deletionGracePeriodSeconds"] = 0
            if new == old:
                return old
            return new if dry_run else self._store(rt, old, new)
        graceful = (
            rt.storage_key == ("", "pods")
            and (new.get("spec") or {}).get("nodeName")
            and (new.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and grace != 0
        )
        grace_s = 0
        if graceful:
            spec_grace = (new.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
            grace_s = max(1, int(grace if grace is not None else spec_grace))
        if rt.plural == "namespaces" and not rt.group:
            new.setdefault("status", {})["phase"] = "Terminating"
        if finalizers or graceful or not self._may_vanish(rt, new):
            meta["deletionTimestamp"] = now_rfc3339(grace_s)
            meta["deletionGracePeriodSeconds"] = grace_s
            if has_generation(rt):
                meta["generation"] = int(meta.get("generation", 1)) + 1
            if dry_run:
                return new
            stored = self._store(rt, old, new)
            self._request_gc()
            return stored
        if dry_run:
            return old
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        del self._objects[rt.storage_key][(meta.get("namespace", ""), meta["name"])]
        self._emit("DELETED", rt.storage_key, new, old)
        self._after_removal(rt, new)
        return new

    def _check_namespace_open(self, namespace: str) -> None:
        ns_type = self.resolve("", "v1", "namespaces")
        ns = self.find(ns_type, None, namespace)
        if ns is None:
            raise ApiError(
                404, "NotFound", f'namespaces "{namespace}" not found', details(ns_type, namespace)
            )
        if _deleting(ns):
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being "
                "terminated",
            )

    def _after_write(self, rt: ResourceType, obj: Obj) -> None:
        if rt.storage_key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            types = crd_types(obj)
            group, plural = types[0].group, types[0].plural
            objects = self._objects.get((group, plural), {})
            for key in [k for k in self._types if (k[0], k[2]) == (group, plural)]:
                del self._types[key]
            self._storage_type.pop((group, plural), None)
            for new_type in types:
                self._register(new_type)
            self._objects[(group, plural)] = objects
        self._request_gc()

    def _after_removal(self, rt: ResourceType, obj: Obj) -> None:
        if rt.storage_key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            spec = obj.get("spec") or {}
            self._unregister(spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        self._request_gc()

    # -- garbage collection and cleanup controllers -----------------------------------------

    def _request_gc(self) -> None:
        if self._gc_pending:
            return
        self._gc_pending = True
        if self._schedule is None:
            self.collect_garbage()
        else:
            self._schedule(self.collect_garbage)

    def collect_garbage(self) -> None:
        """Run the cleanup controllers until nothing changes (bounded)."""
        self._gc_pending = False
        for _ in range(_MAX_GC_PASSES):
            if not collect_pass(self):
                return
