"""The chart's RBAC against what the operator calls: all of it granted, nothing more.

What the operator calls is listed in code (``gradientmail_operator.kube``: ``CALLS``,
``FRAMEWORK_CALLS``, ``CLUSTER_SCANNING_CALLS``); ``test_install.py`` checks, in turn, that
every request the running operator makes is in those lists and allowed by the installed
Roles. A verb added to the operator without a grant in the chart fails here.
"""

from __future__ import annotations

from typing import Any

import pytest

from gradientmail_operator import kube
from testbed.rbac import ANY_NAMESPACE, Rbac, Request, required
from tests.charts import helm
from tests.charts.helm import NAMESPACE, find

MODES = {
    "cluster-wide": [],
    "one namespace": ["team-a"],
    "two namespaces": ["team-a", "team-b"],
    "the release namespace too": [NAMESPACE, "team-a"],
}


def _rbac(watch: list[str]) -> tuple[Rbac, list[dict[str, Any]]]:
    docs = helm.template({"watchNamespaces": watch})
    account = find(docs, "ServiceAccount")[0]["metadata"]["name"]
    return Rbac(docs, NAMESPACE, account), docs


@pytest.mark.parametrize("mode", list(MODES))
def test_the_chart_grants_exactly_what_the_operator_calls(mode: str) -> None:
    watch = MODES[mode]
    rbac, docs = _rbac(watch)
    needed = required(watch)
    missing = sorted(str(r) for r in needed if not rbac.allows(r))
    assert not missing, f"the chart does not grant: {missing}"
    for rule in rbac.rules():
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {rule}"
        assert not rule.get("resourceNames")
    extra = sorted(str(r) for r in rbac.granted(watch) - needed)
    assert not extra, f"the chart grants more than the operator calls: {extra}"
    if watch:
        # Namespaced: nothing cluster-wide, and nothing outside the watched namespaces.
        assert not find(docs, "ClusterRole")
        assert not find(docs, "ClusterRoleBinding")
        assert not rbac.allows(Request("list", "", "pods", "elsewhere"))
        assert not rbac.allows(Request("get", "", "secrets", "elsewhere"))
        assert not rbac.allows(
            Request("list", "apiextensions.k8s.io", "customresourcedefinitions", None)
        )
    else:
        assert rbac.allows(Request("create", "", "pods", "any-namespace-at-all"))
        # kopf lists and watches the runs across all namespaces at once: a ClusterRole's job.
        assert rbac.allows(Request("watch", "gradientmail.dev", "gradientmailruns", None))


def test_a_call_the_chart_does_not_grant_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    rbac, _ = _rbac([])
    monkeypatch.setitem(kube.CALLS, ("", "configmaps"), frozenset({"get"}))
    monkeypatch.setitem(kube.CALLS, ("", "pods"), frozenset({"list", "create", "delete", "patch"}))
    missing = {r for r in required([]) if not rbac.allows(r)}
    assert missing == {
        Request("get", "", "configmaps", ANY_NAMESPACE),
        Request("patch", "", "pods", ANY_NAMESPACE),
    }


def test_the_evaluator_follows_bindings() -> None:
    docs = [
        {
            "kind": "Role",
            "metadata": {"name": "r", "namespace": "a"},
            "rules": [{"apiGroups": [""], "resources": ["pods/*"], "verbs": ["get"]}],
        },
        {
            "kind": "RoleBinding",
            "metadata": {"name": "b", "namespace": "a"},
            "roleRef": {"kind": "Role", "name": "r"},
            "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "ops"}],
        },
        {
            "kind": "ClusterRole",
            "metadata": {"name": "c"},
            "rules": [{"apiGroups": ["*"], "resources": ["events"], "verbs": ["create"]}],
        },
        {
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "cb"},
            "roleRef": {"kind": "ClusterRole", "name": "c"},
            "subjects": [{"kind": "ServiceAccount", "name": "other", "namespace": "ops"}],
        },
    ]
    rbac = Rbac(docs, "ops", "op")
    assert rbac.allows(Request("get", "", "pods/log", "a"))
    assert not rbac.allows(Request("get", "", "pods", "a"))  # pods/* is subresources only
    assert not rbac.allows(Request("get", "", "pods/log", "b"))
    assert not rbac.allows(Request("create", "", "events", "a"))  # bound to another account
