"""The emulated API server's semantics, one by one, over HTTP (no kubelet)."""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.kube.client import KubeApi, KubeApiError
from testbed.kube.fixtures import KubeCluster, start_cluster
from testbed.kube.patches import (
    PatchError,
    PatchTestFailed,
    json_patch,
    merge_patch,
    strategic_merge_patch,
)
from testbed.kube.selectors import FieldSelector, LabelSelector, SelectorError
from testbed.kube.tables import human_age, jsonpath
from tests.support.waiting import wait_until

Obj = dict[str, Any]

NS = "/api/v1/namespaces/default"
CM = f"{NS}/configmaps"
GROUP = "demo.gradientmail.dev"
WIDGETS = f"/apis/{GROUP}/v1/namespaces/default/widgets"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"

WIDGET_CRD: Obj = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {
            "plural": "widgets",
            "singular": "widget",
            "kind": "Widget",
            "shortNames": ["wd"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object"}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                    {
                        "name": "Ready",
                        "type": "string",
                        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                    },
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }
        ],
    },
}


@pytest.fixture
def api(kube_apiserver: KubeCluster) -> KubeApi:
    return kube_apiserver.api


@pytest.fixture
def widgets(api: KubeApi) -> KubeApi:
    """The API with the Widget CRD registered."""
    api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD)
    return api


def widget(name: str, size: int = 1, **meta: Any) -> Obj:
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "Widget",
        "metadata": {"name": name, **meta},
        "spec": {"size": size},
    }


def configmap(name: str, **meta: Any) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}}


def status_of(call: Any) -> KubeApiError:
    with pytest.raises(KubeApiError) as failed:
        call()
    return failed.value


# -- discovery -----------------------------------------------------------------------------


def test_core_discovery_names_group_version_v1_and_subresources(api: KubeApi) -> None:
    assert api.get("/api")["versions"] == ["v1"]
    core = api.get("/api/v1")
    assert core["kind"] == "APIResourceList"
    assert core["groupVersion"] == "v1"
    names = {r["name"]: r for r in core["resources"]}
    assert {"pods", "pods/status", "pods/log", "namespaces", "configmaps", "events"} <= set(names)
    assert names["pods"]["namespaced"]
    assert not names["namespaces"]["namespaced"]
    assert "po" in names["pods"]["shortNames"]
    groups = {g["name"]: g for g in api.get("/apis")["groups"]}
    assert {"apps", "coordination.k8s.io", "events.k8s.io", "apiextensions.k8s.io"} <= set(groups)
    assert groups["apps"]["preferredVersion"]["groupVersion"] == "apps/v1"
    assert api.get("/apis/coordination.k8s.io")["kind"] == "APIGroup"
    leases = api.get("/apis/coordination.k8s.io/v1")
    assert leases["groupVersion"] == "coordination.k8s.io/v1"
    assert api.get("/version")["major"] == "1"
    assert status_of(lambda: api.get("/apis/nope.example.com/v1")).status == 404
    assert api.get("/openapi/v2") == ""  # an empty protobuf document: no schemas
    gv_url = api.get("/openapi/v3")["paths"]["apis/apps/v1"]["serverRelativeURL"]
    apps = api.get(gv_url.split("?")[0])
    patch = apps["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"]["kind"] == "Deployment"
    assert "fieldValidation" in [p["name"] for p in patch["parameters"]]


def test_crd_registers_its_type_and_is_established(api: KubeApi) -> None:
    crd = api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", WIDGET_CRD)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd["status"]["acceptedNames"]["kind"] == "Widget"
    group = api.get(f"/apis/{GROUP}")
    assert group["preferredVersion"]["version"] == "v1"
    resources = {r["name"]: r for r in api.get(f"/apis/{GROUP}/v1")["resources"]}
    assert resources["widgets"]["kind"] == "Widget"
    assert resources["widgets"]["namespaced"] is True
    assert resources["widgets"]["shortNames"] == ["wd"]
    assert "widgets/status" in resources
    created = api.create(WIDGETS, widget("w1"))
    assert created["kind"] == "Widget"


def test_cluster_scoped_crd_and_invalid_crds(api: KubeApi) -> None:
    crd = {
        **WIDGET_CRD,
        "metadata": {"name": f"gadgets.{GROUP}"},
        "spec": {
            **WIDGET_CRD["spec"],
            "scope": "Cluster",
            "names": {"plural": "gadgets", "kind": "Gadget"},
        },
    }
    api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    resources = {r["name"]: r for r in api.get(f"/apis/{GROUP}/v1")["resources"]}
    assert resources["gadgets"]["namespaced"] is False
    api.create(f"/apis/{GROUP}/v1/gadgets", {"metadata": {"name": "g"}, "spec": {}})
    assert api.get(f"/apis/{GROUP}/v1/gadgets/g")["metadata"].get("namespace") is None
    bad = {**crd, "metadata": {"name": "wrong-name"}}
    failed = status_of(
        lambda: api.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", bad)
    )
    assert failed.status == 422
    assert failed.reason == "Invalid"


# -- create, read, errors ------------------------------------------------------------------


def test_create_sets_server_fields_and_refuses_duplicates(api: KubeApi) -> None:
    created = api.create(CM, configmap("one", uid="mine", resourceVersion="999"))
    meta = created["metadata"]
    assert meta["uid"] != "mine"
    assert len(meta["uid"]) == 36
    assert int(meta["resourceVersion"]) < 999
    assert meta["creationTimestamp"].endswith("Z")
    assert "generation" not in meta  # config maps have none, as in a real cluster
    generated = api.create(CM, {"metadata": {"generateName": "gen-"}})
    assert generated["metadata"]["name"].startswith("gen-")
    assert len(generated["metadata"]["name"]) == len("gen-") + 5
    failed = status_of(lambda: api.create(CM, configmap("one")))
    assert failed.status == 409
    assert failed.reason == "AlreadyExists"
    assert failed.body["kind"] == "Status"
    assert failed.body["code"] == 409
    missing = status_of(lambda: api.get(f"{CM}/nope"))
    assert missing.status == 404
    assert missing.reason == "NotFound"
    assert missing.body["details"] == {"name": "nope", "kind": "configmaps"}


def test_custom_resources_get_generation_and_validation(widgets: KubeApi) -> None:
    created = widgets.create(WIDGETS, widget("w1"))
    assert created["metadata"]["generation"] == 1
    bad_name = status_of(lambda: widgets.create(WIDGETS, widget("Not_A_Name")))
    assert bad_name.status == 422
    bad_label = status_of(lambda: widgets.create(WIDGETS, widget("w2", labels={"a": "b c"})))
    assert bad_label.status == 422
    wrong_kind = status_of(lambda: widgets.create(WIDGETS, {**widget("w3"), "kind": "Other"}))
    assert wrong_kind.status == 400


def test_namespaces_list_and_namespace_checks(api: KubeApi) -> None:
    listing = api.get("/api/v1/namespaces")
    assert listing["kind"] == "NamespaceList"
    assert listing["apiVersion"] == "v1"
    names = [n["metadata"]["name"] for n in listing["items"]]
    assert "default" in names
    assert "kube-system" in names
    assert api.get("/api/v1/namespaces/default")["status"]["phase"] == "Active"
    failed = status_of(lambda: api.create("/api/v1/namespaces/ghost/configmaps", configmap("c")))
    assert failed.status == 404


def test_lists_carry_kind_api_version_and_paginate(api: KubeApi) -> None:
    for index in range(5):
        api.create(CM, configmap(f"cm-{index}"))
    listing = api.get(CM)
    assert listing["kind"] == "ConfigMapList"
    assert listing["apiVersion"] == "v1"
    assert int(listing["metadata"]["resourceVersion"]) >= 5
    assert all(item["kind"] == "ConfigMap" for item in listing["items"])
    seen: list[str] = []
    page = api.get(CM, limit="2")
    for _ in range(5):
        seen += [item["metadata"]["name"] for item in page["items"]]
        token = page["metadata"].get("continue")
        if not token:
            break
        page = api.get(CM, limit="2", **{"continue": token})
    assert seen == [f"cm-{index}" for index in range(5)]
    everywhere = api.get("/api/v1/configmaps")
    assert len(everywhere["items"]) == 5


def test_secret_string_data_is_encoded(api: KubeApi) -> None:
    created = api.create(
        f"{NS}/secrets", {"metadata": {"name": "s"}, "stringData": {"password": "hunter2"}}
    )
    assert created["data"] == {"password": "aHVudGVyMg=="}
    assert "stringData" not in created
    assert created["type"] == "Opaque"


def test_protobuf_bodies_are_refused(api: KubeApi) -> None:
    failed = status_of(
        lambda: api.request("POST", CM, body={}, content_type="application/vnd.kubernetes.protobuf")
    )
    assert failed.status == 415


# -- updates -------------------------------------------------------------------------------


def test_merge_patch_and_noop_patch(widgets: KubeApi) -> None:
    created = widgets.create(WIDGETS, widget("w1", labels={"a": "1"}))
    patched = widgets.patch(f"{WIDGETS}/w1", {"metadata": {"labels": {"a": None, "b": "2"}}})
    assert patched["metadata"]["labels"] == {"b": "2"}
    assert int(patched["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    assert patched["metadata"]["generation"] == 1  # metadata only
    again = widgets.patch(f"{WIDGETS}/w1", {"metadata": {"labels": {"b": "2"}}})
    assert again["metadata"]["resourceVersion"] == patched["metadata"]["resourceVersion"]
    spec = widgets.patch(f"{WIDGETS}/w1", {"spec": {"size": 5}})
    assert spec["metadata"]["generation"] == 2
    assert spec["spec"]["size"] == 5


def test_json_patch_test_failure_is_422(widgets: KubeApi) -> None:
    created = widgets.create(WIDGETS, widget("w1"))
    rv = created["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["x/y"]},
    ]
    patched = widgets.patch(f"{WIDGETS}/w1", ops, "json")
    assert patched["metadata"]["finalizers"] == ["x/y"]
    stale = status_of(lambda: widgets.patch(f"{WIDGETS}/w1", ops, "json"))
    assert stale.status == 422
    assert stale.reason == "Invalid"
    assert widgets.get(f"{WIDGETS}/w1")["metadata"]["finalizers"] == ["x/y"]  # unchanged
    broken = status_of(
        lambda: widgets.patch(f"{WIDGETS}/w1", [{"op": "remove", "path": "/nope"}], "json")
    )
    assert broken.status == 422


def test_strategic_merge_patch_merges_lists_by_key(api: KubeApi) -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {
            "containers": [
                {"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}]},
                {"name": "b", "image": "y"},
            ]
        },
    }
    api.create(f"{NS}/pods", pod)
    patch = {
        "metadata": {"finalizers": ["f/1"]},
        "spec": {
            "containers": [
                {"name": "a", "env": [{"name": "L", "value": "2"}]},
                {"name": "b", "$patch": "delete"},
            ]
        },
    }
    patched = api.patch(f"{NS}/pods/p", patch, "strategic")
    containers = patched["spec"]["containers"]
    assert [c["name"] for c in containers] == ["a"]
    assert containers[0]["image"] == "x"
    assert containers[0]["env"] == [{"name": "K", "value": "1"}, {"name": "L", "value": "2"}]
    patched = api.patch(f"{NS}/pods/p", {"metadata": {"finalizers": ["f/2"]}}, "strategic")
    assert patched["metadata"]["finalizers"] == ["f/1", "f/2"]


def test_strategic_merge_patch_on_custom_resources_is_415(widgets: KubeApi) -> None:
    widgets.create(WIDGETS, widget("w1"))
    failed = status_of(lambda: widgets.patch(f"{WIDGETS}/w1", {"spec": {}}, "strategic"))
    assert failed.status == 415


def test_put_replaces_and_stale_resource_version_conflicts(widgets: KubeApi) -> None:
    created = widgets.create(WIDGETS, widget("w1", size=1))
    replaced = widgets.replace(f"{WIDGETS}/w1", {**created, "spec": {"size": 2}})
    assert replaced["spec"] == {"size": 2}
    assert replaced["metadata"]["uid"] == created["metadata"]["uid"]
    stale = status_of(lambda: widgets.replace(f"{WIDGETS}/w1", {**created, "spec": {"size": 3}}))
    assert stale.status == 409
    assert stale.reason == "Conflict"
    unversioned = {**widget("w1", size=4)}
    failed = status_of(lambda: widgets.replace(f"{WIDGETS}/w1", unversioned))
    assert failed.status == 422  # custom resources need a resourceVersion on PUT
    stale_patch = {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]}}
    assert status_of(lambda: widgets.patch(f"{WIDGETS}/w1", stale_patch)).status == 409
    api_cm = widgets.create(CM, configmap("c"))
    assert widgets.replace(f"{CM}/c", {**configmap("c"), "data": {"k": "v"}})["data"] == {"k": "v"}
    assert api_cm["metadata"]["name"] == "c"


def test_status_subresource_is_isolated(widgets: KubeApi) -> None:
    created = widgets.create(WIDGETS, {**widget("w1"), "status": {"phase": "Ignored"}})
    assert "status" not in created
    main = widgets.patch(f"{WIDGETS}/w1", {"spec": {"size": 2}, "status": {"phase": "Nope"}})
    assert "status" not in main
    assert main["spec"]["size"] == 2
    status = widgets.patch(
        f"{WIDGETS}/w1/status", {"spec": {"size": 9}, "status": {"phase": "Running"}}
    )
    assert status["status"] == {"phase": "Running"}
    assert status["spec"]["size"] == 2
    assert status["metadata"]["generation"] == 2  # status writes never bump it
    assert widgets.get(f"{WIDGETS}/w1/status")["status"]["phase"] == "Running"
    full = widgets.get(f"{WIDGETS}/w1")
    full["status"] = {"phase": "Done"}
    full["spec"] = {"size": 3}
    put = widgets.replace(f"{WIDGETS}/w1/status", full)
    assert put["status"] == {"phase": "Done"}
    assert put["spec"]["size"] == 2


# -- selectors -----------------------------------------------------------------------------


def test_label_and_field_selectors(api: KubeApi) -> None:
    api.create(CM, configmap("a", labels={"tier": "web", "env": "prod"}))
    api.create(CM, configmap("b", labels={"tier": "db", "env": "prod"}))
    api.create(CM, configmap("c", labels={"tier": "web"}))

    def names(**params: str) -> list[str]:
        return [item["metadata"]["name"] for item in api.get(CM, **params)["items"]]

    assert names(labelSelector="tier=web") == ["a", "c"]
    assert names(labelSelector="tier!=web") == ["b"]
    assert names(labelSelector="tier in (db,cache),env=prod") == ["b"]
    assert names(labelSelector="tier notin (db)") == ["a", "c"]
    assert names(labelSelector="env") == ["a", "b"]
    assert names(labelSelector="!env") == ["c"]
    assert names(fieldSelector="metadata.name=b") == ["b"]
    assert names(fieldSelector="metadata.name!=b,metadata.namespace=default") == ["a", "c"]
    assert status_of(lambda: api.get(CM, labelSelector="a in b")).status == 400


# -- watches -------------------------------------------------------------------------------


def test_watch_from_list_version_loses_nothing(api: KubeApi) -> None:
    api.create(CM, configmap("before"))
    listing = api.get(CM)
    rv = listing["metadata"]["resourceVersion"]
    api.create(CM, configmap("between"))  # after the list, before the watch starts
    api.patch(f"{CM}/between", {"data": {"k": "v"}})
    api.delete(f"{CM}/before")
    events = list(api.watch(CM, timeout_s=1, resourceVersion=rv))
    seen = [(e["type"], e["object"]["metadata"]["name"]) for e in events]
    assert seen == [("ADDED", "between"), ("MODIFIED", "between"), ("DELETED", "before")]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions)
    assert versions[0] > int(rv)


def test_watch_without_version_starts_with_current_objects_then_follows(api: KubeApi) -> None:
    api.create(CM, configmap("old"))
    events: list[Obj] = []

    def consume() -> None:
        events.extend(api.watch(CM, timeout_s=2))

    watcher = threading.Thread(target=consume)
    watcher.start()
    wait_until(lambda: api.create(CM, configmap("new")) if len(events) >= 1 else None, "initial")
    watcher.join(10)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "old"),
        ("ADDED", "new"),
    ]


def test_watch_honours_selectors_as_objects_start_and_stop_matching(api: KubeApi) -> None:
    rv = api.get(CM)["metadata"]["resourceVersion"]
    api.create(CM, configmap("x", labels={"watched": "yes"}))
    api.patch(f"{CM}/x", {"metadata": {"labels": {"watched": "no"}}})
    api.patch(f"{CM}/x", {"metadata": {"labels": {"watched": "yes"}}})
    api.create(CM, configmap("other"))
    events = list(api.watch(CM, timeout_s=1, resourceVersion=rv, labelSelector="watched=yes"))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "x"),
        ("DELETED", "x"),
        ("ADDED", "x"),
    ]
    by_name = list(
        api.watch(CM, timeout_s=1, resourceVersion=rv, fieldSelector="metadata.name=other")
    )
    assert [e["type"] for e in by_name] == ["ADDED"]


def test_watch_timeout_and_bookmarks(tmp_path: Path) -> None:
    with start_cluster(
        tmp_path, kubelet=False, server_options={"bookmark_interval_s": 0.2}
    ) as cluster:
        started = time.monotonic()
        events = list(cluster.api.watch(CM, timeout_s=1, allowWatchBookmarks="true"))
        elapsed = time.monotonic() - started
        assert 0.9 <= elapsed < 5
        bookmarks = [e for e in events if e["type"] == "BOOKMARK"]
        assert len(bookmarks) >= 2
        assert bookmarks[0]["object"]["kind"] == "ConfigMap"
        assert bookmarks[0]["object"]["metadata"]["resourceVersion"]


def test_send_initial_events_ends_with_annotated_bookmark(api: KubeApi) -> None:
    api.create(CM, configmap("one"))
    events = list(
        api.watch(
            CM,
            timeout_s=1,
            sendInitialEvents="true",
            allowWatchBookmarks="true",
            resourceVersionMatch="NotOlderThan",
        )
    )
    assert events[0]["type"] == "ADDED"
    assert events[1]["type"] == "BOOKMARK"
    annotations = events[1]["object"]["metadata"]["annotations"]
    assert annotations == {"k8s.io/initial-events-end": "true"}


def test_watch_from_a_version_too_old_is_410(tmp_path: Path) -> None:
    with start_cluster(tmp_path, kubelet=False, server_options={"history_size": 3}) as cluster:
        api = cluster.api
        rv = api.get(CM)["metadata"]["resourceVersion"]
        for index in range(5):
            api.create(CM, configmap(f"c{index}"))
        events = list(api.watch(CM, timeout_s=1, resourceVersion=rv))
        assert [e["type"] for e in events] == ["ERROR"]
        assert events[0]["object"]["code"] == 410


def test_watch_delivers_tables_when_asked(widgets: KubeApi) -> None:
    rv = widgets.get(WIDGETS)["metadata"]["resourceVersion"]
    widgets.create(WIDGETS, widget("w1", size=3))
    response = widgets.session.get(
        widgets.base_url + WIDGETS,
        params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "1"},
        headers={"Accept": TABLE},
        timeout=10,
    )
    events = [json.loads(line) for line in response.text.splitlines() if line]
    table = events[0]["object"]
    assert table["kind"] == "Table"
    assert table["rows"][0]["cells"][:3] == ["w1", None, 3]


# -- deletion ------------------------------------------------------------------------------


def test_finalizers_hold_deletion_until_removed(widgets: KubeApi) -> None:
    widgets.create(WIDGETS, widget("w1", finalizers=["demo/hold"]))
    rv = widgets.get(WIDGETS)["metadata"]["resourceVersion"]
    deleting = widgets.delete(f"{WIDGETS}/w1")
    assert deleting["metadata"]["deletionTimestamp"]
    assert deleting["metadata"]["generation"] == 2
    assert widgets.exists(f"{WIDGETS}/w1")
    refused = status_of(
        lambda: widgets.patch(f"{WIDGETS}/w1", {"metadata": {"finalizers": ["demo/hold", "x/y"]}})
    )
    assert refused.status == 422
    widgets.patch(f"{WIDGETS}/w1", {"metadata": {"finalizers": None}})
    assert not widgets.exists(f"{WIDGETS}/w1")
    events = list(widgets.watch(WIDGETS, timeout_s=1, resourceVersion=rv))
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]


def _owned(name: str, *owners: Obj) -> Obj:
    refs = [
        {
            "apiVersion": o["apiVersion"],
            "kind": o["kind"],
            "name": o["metadata"]["name"],
            "uid": o["metadata"]["uid"],
            "blockOwnerDeletion": True,
        }
        for o in owners
    ]
    return configmap(name, ownerReferences=refs)


def test_background_garbage_collection(widgets: KubeApi) -> None:
    first = widgets.create(WIDGETS, widget("first"))
    second = widgets.create(WIDGETS, widget("second"))
    widgets.create(CM, _owned("only-first", first))
    widgets.create(CM, _owned("both", first, second))
    widgets.delete(f"{WIDGETS}/first")
    wait_until(lambda: not widgets.exists(f"{CM}/only-first"), "the dependent to be collected")
    both = widgets.get(f"{CM}/both")
    assert [r["name"] for r in both["metadata"]["ownerReferences"]] == ["second"]
    ghost = {**first, "metadata": {**first["metadata"], "uid": "00000000-dead"}}
    widgets.create(CM, _owned("orphaned-at-birth", ghost))
    wait_until(lambda: not widgets.exists(f"{CM}/orphaned-at-birth"), "a dangling dependent")


def test_orphan_and_foreground_propagation(widgets: KubeApi) -> None:
    owner = widgets.create(WIDGETS, widget("orphaner"))
    widgets.create(CM, _owned("kept", owner))
    widgets.delete(f"{WIDGETS}/orphaner", propagationPolicy="Orphan")
    wait_until(lambda: not widgets.exists(f"{WIDGETS}/orphaner"), "the orphaning owner to go")
    assert widgets.get(f"{CM}/kept")["metadata"].get("ownerReferences", []) == []

    owner = widgets.create(WIDGETS, widget("foreground"))
    child = widgets.create(CM, {**_owned("blocking", owner)})
    widgets.patch(f"{CM}/blocking", {"metadata": {"finalizers": ["demo/slow"]}})
    widgets.delete(f"{WIDGETS}/foreground", propagationPolicy="Foreground")
    held = widgets.get(f"{WIDGETS}/foreground")
    assert "foregroundDeletion" in held["metadata"]["finalizers"]
    assert widgets.get(f"{CM}/blocking")["metadata"]["deletionTimestamp"]
    widgets.patch(f"{CM}/blocking", {"metadata": {"finalizers": None}})
    wait_until(lambda: not widgets.exists(f"{WIDGETS}/foreground"), "the foreground owner to go")
    assert child["metadata"]["name"] == "blocking"


def test_delete_collection_with_a_selector(api: KubeApi) -> None:
    api.create(CM, configmap("a", labels={"batch": "1"}))
    api.create(CM, configmap("b", labels={"batch": "1"}))
    api.create(CM, configmap("c", labels={"batch": "2"}))
    deleted = api.request("DELETE", CM, params={"labelSelector": "batch=1"})
    assert [i["metadata"]["name"] for i in deleted["items"]] == ["a", "b"]
    assert [i["metadata"]["name"] for i in api.get(CM)["items"]] == ["c"]


def test_delete_preconditions(api: KubeApi) -> None:
    api.create(CM, configmap("c"))
    failed = status_of(lambda: api.delete(f"{CM}/c", preconditions={"uid": "other"}))
    assert failed.status == 409
    api.delete(f"{CM}/c")
    assert status_of(lambda: api.delete(f"{CM}/c")).status == 404


def test_deleting_a_namespace_deletes_its_contents(api: KubeApi) -> None:
    api.create("/api/v1/namespaces", {"metadata": {"name": "scratch"}})
    api.create("/api/v1/namespaces/scratch/configmaps", configmap("c1"))
    api.create("/api/v1/namespaces/scratch/configmaps", configmap("c2", finalizers=["demo/x"]))
    api.delete("/api/v1/namespaces/scratch")
    assert api.get("/api/v1/namespaces/scratch")["status"]["phase"] == "Terminating"
    refused = status_of(
        lambda: api.create("/api/v1/namespaces/scratch/configmaps", configmap("c3"))
    )
    assert refused.status == 403
    assert not api.exists("/api/v1/namespaces/scratch/configmaps/c1")
    api.patch("/api/v1/namespaces/scratch/configmaps/c2", {"metadata": {"finalizers": None}})
    wait_until(lambda: not api.exists("/api/v1/namespaces/scratch"), "the namespace to go")


def test_deleting_a_crd_deletes_its_resources_and_type(widgets: KubeApi) -> None:
    widgets.create(WIDGETS, widget("w1"))
    widgets.delete(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.{GROUP}")
    wait_until(
        lambda: (
            not widgets.exists(
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.{GROUP}"
            )
        ),
        "the CRD to go",
    )
    assert status_of(lambda: widgets.get(WIDGETS)).status == 404
    assert status_of(lambda: widgets.get(f"/apis/{GROUP}/v1")).status == 404


# -- tables --------------------------------------------------------------------------------


def test_tables_with_printer_columns(widgets: KubeApi) -> None:
    widgets.create(WIDGETS, widget("w1", size=7))
    widgets.patch(
        f"{WIDGETS}/w1/status",
        {"status": {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}]}},
    )
    table = widgets.request("GET", WIDGETS, headers={"Accept": TABLE})
    assert table["kind"] == "Table"
    assert table["apiVersion"] == "meta.k8s.io/v1"
    assert [c["name"] for c in table["columnDefinitions"]] == [
        "Name",
        "Phase",
        "Size",
        "Ready",
        "Age",
    ]
    cells = table["rows"][0]["cells"]
    assert cells[:4] == ["w1", "Ready", 7, "True"]
    assert cells[4].endswith("s")
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    single = widgets.request(
        "GET", f"{WIDGETS}/w1", headers={"Accept": TABLE}, params={"includeObject": "Object"}
    )
    assert single["rows"][0]["object"]["spec"] == {"size": 7}
    pods = widgets.request("GET", f"{NS}/pods", headers={"Accept": TABLE})
    assert [c["name"] for c in pods["columnDefinitions"]][:5] == [
        "Name",
        "Ready",
        "Status",
        "Restarts",
        "Age",
    ]
    plain = widgets.get(WIDGETS)
    assert plain["kind"] == "WidgetList"


# -- events and leases ---------------------------------------------------------------------


def test_events_and_leases_are_stored(api: KubeApi) -> None:
    event = {
        "metadata": {"generateName": "kopf-event-"},
        "type": "Normal",
        "reason": "Created",
        "message": "hello",
        "involvedObject": {"kind": "Widget", "name": "w1", "namespace": "default", "uid": "u1"},
    }
    api.create(f"{NS}/events", event)
    api.create(f"{NS}/events", {**event, "involvedObject": {"kind": "Widget", "name": "w2"}})
    found = api.get(f"{NS}/events", fieldSelector="involvedObject.name=w1,involvedObject.uid=u1")
    assert [e["message"] for e in found["items"]] == ["hello"]
    new_style = {"metadata": {"name": "e"}, "reason": "R", "note": "n", "action": "A"}
    api.create("/apis/events.k8s.io/v1/namespaces/default/events", new_style)
    lease = {"metadata": {"name": "leader"}, "spec": {"holderIdentity": "me"}}
    api.create("/apis/coordination.k8s.io/v1/namespaces/default/leases", lease)
    got = api.get("/apis/coordination.k8s.io/v1/namespaces/default/leases/leader")
    assert got["spec"]["holderIdentity"] == "me"


# -- pods without a kubelet ----------------------------------------------------------------


def test_pods_get_pending_status_and_bind(api: KubeApi) -> None:
    created = api.create(f"{NS}/pods", {"metadata": {"name": "p"}, "spec": {"containers": []}})
    assert created["status"]["phase"] == "Pending"
    assert created["spec"]["restartPolicy"] == "Always"
    api.create(f"{NS}/pods/p/binding", {"target": {"kind": "Node", "name": "n1"}})
    assert api.get(f"{NS}/pods/p")["spec"]["nodeName"] == "n1"
    again = status_of(lambda: api.create(f"{NS}/pods/p/binding", {"target": {"name": "n2"}}))
    assert again.status == 409
    # Bound and not finished: deletion is graceful, until the kubelet confirms.
    api.delete(f"{NS}/pods/p")
    assert api.get(f"{NS}/pods/p")["metadata"]["deletionGracePeriodSeconds"] == 30
    api.delete(f"{NS}/pods/p", gracePeriodSeconds=0)
    assert not api.exists(f"{NS}/pods/p")


@pytest.fixture
def kubernetes_client(kube_apiserver: KubeCluster) -> Iterator[Any]:
    import kubernetes

    client = kubernetes.config.new_client_from_config(config_file=str(kube_apiserver.kubeconfig))
    yield client
    client.close()


def test_the_kubernetes_python_client_works(kubernetes_client: Any) -> None:
    import kubernetes

    core = kubernetes.client.CoreV1Api(kubernetes_client)
    core.create_namespaced_config_map("default", {"metadata": {"name": "from-client"}})
    names = [cm.metadata.name for cm in core.list_namespaced_config_map("default").items]
    assert names == ["from-client"]
    watch = kubernetes.watch.Watch()
    events = list(watch.stream(core.list_namespaced_config_map, "default", timeout_seconds=1))
    assert [e["type"] for e in events] == ["ADDED"]
    with pytest.raises(kubernetes.client.ApiException) as failed:
        core.read_namespaced_config_map("nope", "default")
    assert failed.value.status == 404


# -- the pure parts ------------------------------------------------------------------------


def test_json_patch_operations() -> None:
    doc = {"a": {"b": [1, 2]}, "c": 1}
    ops = [
        {"op": "add", "path": "/a/b/-", "value": 3},
        {"op": "move", "from": "/c", "path": "/d"},
        {"op": "copy", "from": "/a/b/0", "path": "/e"},
        {"op": "replace", "path": "/a/b/1", "value": 20},
        {"op": "test", "path": "/d", "value": 1},
        {"op": "remove", "path": "/a/b/0"},
        {"op": "add", "path": "/f~1g", "value": True},
    ]
    assert json_patch(doc, ops) == {"a": {"b": [20, 3]}, "d": 1, "e": 1, "f/g": True}
    assert doc == {"a": {"b": [1, 2]}, "c": 1}  # untouched
    with pytest.raises(PatchTestFailed):
        json_patch(doc, [{"op": "test", "path": "/c", "value": 2}])
    with pytest.raises(PatchError):
        json_patch(doc, [{"op": "replace", "path": "/missing", "value": 1}])


def test_merge_and_strategic_merge_directives() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}, "l": [1]}, {"a": {"b": None}, "l": [2]}) == {
        "a": {"c": 2},
        "l": [2],
    }
    target = {
        "spec": {
            "containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}],
            "strategy": {"type": "Rolling", "rolling": {"max": 1}},
        },
        "metadata": {"finalizers": ["x", "y"]},
    }
    patch = {
        "spec": {
            "$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
            "containers": [{"name": "a", "image": "3"}],
            "strategy": {"$retainKeys": ["type"], "type": "Recreate"},
        },
        "metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]},
    }
    result = strategic_merge_patch(target, patch)
    assert result["spec"]["containers"] == [
        {"name": "b", "image": "2"},
        {"name": "a", "image": "3"},
    ]
    assert result["spec"]["strategy"] == {"type": "Recreate"}
    assert result["metadata"]["finalizers"] == ["y"]
    replaced = strategic_merge_patch(
        target, {"spec": {"containers": [{"name": "z"}, {"$patch": "replace"}]}}
    )
    assert replaced["spec"]["containers"] == [{"name": "z"}]


def test_selectors_jsonpath_and_ages() -> None:
    selector = LabelSelector.parse("app in (a, b), !debug, tier")
    assert selector.matches({"app": "a", "tier": "x"})
    assert not selector.matches({"app": "a", "tier": "x", "debug": "1"})
    assert not selector.matches({"app": "c", "tier": "x"})
    with pytest.raises(SelectorError):
        LabelSelector.parse("a b c")
    fields = FieldSelector.parse("status.phase!=Running,metadata.name=p")
    assert fields.matches({"metadata": {"name": "p"}, "status": {"phase": "Failed"}})
    assert fields.exact_name() == "p"
    obj = {
        "status": {
            "conditions": [{"type": "A", "status": "False"}, {"type": "B", "status": "True"}]
        },
        "spec": {"items": [{"n": 1}, {"n": 2}]},
    }
    assert jsonpath(obj, '.status.conditions[?(@.type=="B")].status') == ["True"]
    assert jsonpath(obj, "{.spec.items[*].n}") == [1, 2]
    assert jsonpath(obj, ".spec.items[-1].n") == [2]
    assert jsonpath(obj, ".spec.missing") == []
    base = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    for seconds, text in (
        (5, "5s"),
        (150, "2m30s"),
        (600, "10m"),
        (3 * 3600 + 60, "3h1m"),
        (3 * 86400, "3d"),
    ):
        assert human_age("2026-01-01T00:00:00Z", base + datetime.timedelta(seconds=seconds)) == text
