"""The operator end to end on the Kubernetes stand-in: a real `kopf run`, the real kubectl,
node pods run by the local kubelet as real processes, training on a real S3 server
(SeaweedFS when GRADIENTMAIL_S3_ENDPOINT names one, else a file mailbox).

One cluster and one operator serve every test of this module but the operator restart
(which starts operators of its own): each test names its runs apart, reads only its runs'
events, and its runs (their pods by GC) are deleted when it ends, so the next test starts
with no run and no node process in the namespace.

Where a test needs nodes in a given state (live, or done training with their pods still
running), the test is one more party of the built-in node's ``start``/``done`` barriers
(``spec.barriers``): the nodes wait there until the test has seen what it needs, so no run
has to be "long enough" to be seen.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import gradientmail as gm
from gradientmail.inspect import RunWatcher
from gradientmail.patterns.barrier import Barrier
from testbed.kube.fixtures import KubeCluster, start_cluster
from testbed.s3env import S3Target, ensure_bucket
from testbed.stub_s3 import Reply, closed_port, stub_s3
from tests.conftest import S3_TARGETS
from tests.support.waiting import TEST_TIMEOUT, wait_until

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "charts/gradientmail-operator/crds/gradientmailruns.yaml"
HANDLERS = ROOT / "operator/gradientmail_operator/handlers.py"
# A whole training run on a loaded 2-core machine: 3 nodes of 1500 steps took over 240 s
# with a second CI run and two busy loops beside the suite (a bound, not an expectation).
RUN_TIMEOUT = max(TEST_TIMEOUT, 30) * 20
# The learner id of the test when it takes part in a run's barriers (one party more than the
# run's nodes: the nodes wait there until the test arrives).
TEST_PARTY = "the-test"
# The suite's hang guard (pytest-timeout, 300 s) must not end a wait before its own bound:
# three CI runs and two busy loops beside each other took a whole run past 300 s (still
# training, not stuck). A test waits for up to three such runs' worth of conditions.
pytestmark = pytest.mark.timeout(3 * RUN_TIMEOUT + 120)
OPERATOR_ENV = {
    # The default safety interval (60 s): pods and runs are watched, so every change of
    # theirs must wake the reconcile by itself.
    "GRADIENTMAIL_OPERATOR_STATUS_INTERVAL": "1",
    "GRADIENTMAIL_OPERATOR_RESTART_BACKOFF": "1,4",
    "GRADIENTMAIL_OPERATOR_POLL_BUDGET": "3",
    "GRADIENTMAIL_OPERATOR_METRICS_PORT": "0",
    # The stand-in's pods are processes of one machine: a file mailbox is shared by all.
    "GRADIENTMAIL_OPERATOR_FILE_MAILBOXES": "shared",
}


def _target() -> S3Target | None:
    preferred = [t for t in S3_TARGETS if t.name == "seaweedfs"] or S3_TARGETS
    return preferred[0] if preferred else None


def _mailbox(tmp_path: Path, cluster: KubeCluster) -> dict[str, Any]:
    target = _target()
    if target is None:
        return {"url": (tmp_path / "mailbox").as_uri()}
    ensure_bucket(target)
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3-credentials", "namespace": "default"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            },
        }
    )
    return {
        "endpoint": target.endpoint_url,
        "bucket": target.bucket,
        "prefix": "operator-tests",
        "credentialsSecret": {"name": "s3-credentials"},
    }


def _run(name: str, mailbox: dict[str, Any], **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "nodes": 3,
        "mailbox": mailbox,
        "algorithm": {"syncEvery": 10, "fragments": 2, "steps": 80, "roundTimeout": 2},
        "maxRestarts": 2,
    }
    body.update(spec)
    return {
        "apiVersion": "gradientmail.dev/v1alpha1",
        "kind": "GradientMailRun",
        "metadata": {"name": name, "namespace": "default"},
        "spec": body,
    }


def _get(cluster: KubeCluster, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "gmr", name, "-o", "json").stdout
    return dict(json.loads(out))


def _status(cluster: KubeCluster, name: str) -> dict[str, Any]:
    return dict(_get(cluster, name).get("status") or {})


def _condition(cluster: KubeCluster, name: str, kind: str) -> dict[str, Any] | None:
    for condition in _status(cluster, name).get("conditions") or []:
        if condition.get("type") == kind:
            return dict(condition)
    return None


def _pods(cluster: KubeCluster, run: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "pods", "-l", f"gradientmail.dev/run={run}", "-o", "json").stdout
    return list(json.loads(out)["items"])


def _events(cluster: KubeCluster, reason: str, run: str) -> list[dict[str, Any]]:
    """The events ``reason`` about the run ``run`` (the cluster keeps earlier tests' too)."""
    out = cluster.kubectl("get", "events", "-o", "json").stdout
    return [
        e
        for e in json.loads(out)["items"]
        if e.get("reason") == reason and (e.get("involvedObject") or {}).get("name") == run
    ]


def _release(cluster: KubeCluster, run: str, barrier: str, parties: int) -> None:
    """Arrive at the run's ``barrier`` as its last party: the nodes waiting there go on."""
    url = wait_until(lambda: _status(cluster, run).get("mailbox"), f"{run}'s mailbox")
    party = Barrier(mailbox=gm.open_mailbox(url), learner_id=TEST_PARTY, poll_interval=0.2)
    party.wait(barrier, parties=parties, timeout=RUN_TIMEOUT)


@pytest.fixture(scope="module")
def cluster_with_operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """One cluster and operator for the module (started once: a few seconds per test)."""
    with start_cluster(tmp_path_factory.mktemp("kube")) as cluster:
        cluster.apply(CRD)
        cluster.run_kopf(HANDLERS, namespace="default", env=OPERATOR_ENV, name="operator")
        yield cluster


@pytest.fixture
def operator(cluster_with_operator: KubeCluster) -> Iterator[KubeCluster]:
    """The module's cluster; the test's runs are deleted after it, and their pods awaited
    gone, so no node of this test trains beside (or writes the events of) the next one."""
    cluster = cluster_with_operator
    yield cluster
    cluster.kubectl("delete", "gmr", "--all", "--wait=true", timeout=RUN_TIMEOUT)
    wait_until(
        lambda: not json.loads(cluster.kubectl("get", "pods", "-o", "json").stdout)["items"],
        "the test's pods to be deleted",
        timeout=RUN_TIMEOUT,
    )


def test_a_run_trains_to_succeeded(operator: KubeCluster, tmp_path: Path) -> None:
    cluster = operator
    # The test is a fourth party of three barriers: the nodes wait at "start" with their
    # sessions open (live, no round yet) until the status has shown the three of them live,
    # at "step-100" (the built-in node's barrier after step 100) until the status has shown
    # a round, and at "done" after training (pods still Running) until the status has
    # shown a newer one: the Round column grows while the run is Running, however fast or
    # slow the machine trains.
    parties = 4
    barriers = {"start": parties, "step-100": parties, "done": parties}
    algorithm = {"syncEvery": 10, "fragments": 2, "steps": 200, "roundTimeout": 2}
    cluster.apply(_run("exp", _mailbox(tmp_path, cluster), algorithm=algorithm, barriers=barriers))
    pods = wait_until(lambda: len(_pods(cluster, "exp")) == 3 and _pods(cluster, "exp"), "pods")
    container = pods[0]["spec"]["containers"][0]
    names = {e["name"] for e in container["env"]}
    assert {"GRADIENTMAIL_MAILBOX", "GRADIENTMAIL_LEARNER_ID", "GRADIENTMAIL_BARRIERS"} <= names
    assert pods[0]["spec"]["automountServiceAccountToken"] is False
    assert pods[0]["metadata"]["ownerReferences"][0]["kind"] == "GradientMailRun"
    if _target() is not None:
        secret = os.environ["AWS_SECRET_ACCESS_KEY"]
        assert secret not in json.dumps(pods)
        refs = [e for e in container["env"] if e["name"] == "AWS_SECRET_ACCESS_KEY"]
        assert refs[0]["valueFrom"]["secretKeyRef"]["name"] == "s3-credentials"
    seen: list[str] = []

    def snapshot() -> dict[str, Any]:
        table = cluster.kubectl("get", "gmr").stdout
        if not seen or seen[-1] != table:
            seen.append(table)
        return _status(cluster, "exp")

    def running_rows() -> list[list[str]]:
        """The rows seen while Running: NAME PHASE NODES LIVE [ROUND] AGE (ROUND is left
        out, blank, until a training round commits)."""
        return [
            row
            for table in seen
            for row in (line.split() for line in table.splitlines()[1:])
            if len(row) >= 5 and row[1] == "Running"
        ]

    wait_until(
        lambda: snapshot() and any(row[3] == "3" for row in running_rows()),
        "the status to show the 3 nodes live (they wait at the start barrier)",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    _release(cluster, "exp", "start", parties)
    wait_until(
        lambda: snapshot() and any(len(row) == 6 for row in running_rows()),
        "a round in the status while the run is Running (the nodes wait at step-100)",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    _release(cluster, "exp", "step-100", parties)
    wait_until(
        lambda: snapshot() and len({row[4] for row in running_rows() if len(row) == 6}) >= 2,
        "the Round column to grow while the run is Running (the nodes then wait at done)",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    _release(cluster, "exp", "done", parties)
    final = wait_until(
        lambda: (s := snapshot()).get("phase") == "Succeeded" and s,
        "the run to succeed",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    print("\n".join(seen))  # the closing note quotes this
    running = [line.split() for t in seen for line in t.splitlines()[1:] if "Running" in line]
    live = [int(row[3]) for row in running if len(row) >= 5 and row[3].isdigit()]
    assert max(live, default=0) == 3, f"the status never showed 3 live learners: {seen}"
    assert any("Running" in table for table in seen)
    rounds_seen = {
        line.split()[4]
        for table in seen
        for line in table.splitlines()[1:]
        if "Running" in line and len(line.split()) == 6
    }
    assert len(rounds_seen) >= 2, f"the Round column never grew while running: {seen}"
    assert final["roundsCommitted"] >= 6
    # The last word matches the mailbox: a final poll after the run ended.
    final = wait_until(
        lambda: (s := _status(cluster, "exp")).get("statusFinal") and s, "the final status"
    )
    fresh = asyncio.run(RunWatcher(gm.open_mailbox(final["mailbox"])).poll())
    assert (final["roundsCommitted"], final["newestRound"]) == (
        fresh.rounds_committed,
        fresh.newest_round,
    )
    # Sync points, from the learners' beats: every learner reached and contributed at them,
    # and none was skipped (the default policy waits rather than skip).
    assert final["syncPointsReached"] > 0, final
    assert final["syncPointsContributed"] > 0, final
    assert final["syncPointsSkipped"] == 0, final
    assert final["waitedSeconds"] >= 0.0
    assert all(learner["syncPoints"] > 0 for learner in final["learners"]), final["learners"]
    synced = _condition(cluster, "exp", "SyncPointsContributed")
    assert synced is not None
    assert synced["status"] == "True", synced
    assert synced["reason"] in ("AllSyncPointsContributed", "WaitingAtSyncPoints"), synced
    assert final["prefix"].startswith("default/exp-")
    assert _condition(cluster, "exp", "Complete")["status"] == "True"
    assert _events(cluster, "AllNodesSucceeded", "exp")
    if _target() is not None:
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in json.dumps(_get(cluster, "exp"))


def test_a_killed_node_is_replaced_and_rejoins(operator: KubeCluster, tmp_path: Path) -> None:
    cluster = operator
    # The nodes wait at the done barrier (the test is its fourth party) until the killed
    # node's replacement exists: the kill finds node 1 alive, training or done, however
    # short the run; the replacement rejoins under its learner id either way.
    parties = 4
    cluster.apply(
        _run(
            "kill",
            _mailbox(tmp_path, cluster),
            algorithm={"syncEvery": 10, "fragments": 2, "steps": 60, "roundTimeout": 2},
            barriers={"done": parties},
        )
    )
    wait_until(
        lambda: (_status(cluster, "kill").get("newestRound") or 0) >= 3,
        "rounds before the kill",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    cluster.kill("kill-node-1")
    wait_until(
        lambda: _events(cluster, "PodReplaced", "kill"), "the replacement", timeout=RUN_TIMEOUT
    )
    _release(cluster, "kill", "done", parties)
    final = wait_until(
        lambda: (s := _status(cluster, "kill")).get("phase") in ("Succeeded", "Failed") and s,
        "the run to finish",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    assert final["phase"] == "Succeeded", final
    assert final["restarts"] == 1


def test_an_operator_restart_keeps_pods_and_prefix(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    cluster = kube_cluster
    cluster.apply(CRD)
    first = cluster.run_kopf(HANDLERS, namespace="default", env=OPERATOR_ENV, name="op-1")
    # The nodes wait at the start barrier (the test is its fourth party) until the first
    # operator is stopped and the second started: the restart happens while every node is
    # live, however short the run (20 steps: what is checked is the pods and the prefix).
    parties = 4
    algorithm = {"syncEvery": 10, "fragments": 2, "steps": 20, "roundTimeout": 2}
    cluster.apply(
        _run(
            "restart",
            _mailbox(tmp_path, cluster),
            algorithm=algorithm,
            barriers={"start": parties},
        )
    )
    before = wait_until(
        lambda: len(p := _pods(cluster, "restart")) == 3 and p, "pods", timeout=RUN_TIMEOUT
    )
    prefix = wait_until(lambda: _status(cluster, "restart").get("prefix"), "the prefix")
    first.stop()
    cluster.run_kopf(HANDLERS, namespace="default", env=OPERATOR_ENV, name="op-2")
    _release(cluster, "restart", "start", parties)
    final = wait_until(
        lambda: (s := _status(cluster, "restart")).get("phase") == "Succeeded" and s,
        "the run to succeed",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    assert final["prefix"] == prefix
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in before}
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in _pods(cluster, "restart")}
    assert after == uids, "the restarted operator created or replaced pods"


@pytest.mark.parametrize(
    ("spec", "reason", "fragment"),
    [
        ({"nodes": 0}, "InvalidSpec", "spec.nodes"),
        ({"maxRestarts": -1}, "InvalidSpec", "spec.maxRestarts"),
        ({"barriers": {"no/slash": 2}}, "InvalidSpec", "barrier name"),
        ({"surprise": True}, "InvalidSpec", "spec.surprise"),
    ],
)
def test_bad_specs_get_a_condition_and_an_event(
    operator: KubeCluster, tmp_path: Path, spec: dict[str, Any], reason: str, fragment: str
) -> None:
    cluster = operator
    case = re.sub(r"[^a-z0-9]+", "-", fragment.lower()).strip("-")  # runs apart per case
    bad, good = f"bad-{case}", f"good-{case}"
    cluster.apply(_run(bad, {"url": (tmp_path / "box").as_uri()}, **spec))
    condition = wait_until(
        lambda: (c := _condition(cluster, bad, "SpecValid")) and c["status"] == "False" and c,
        "the SpecValid condition",
    )
    assert condition["reason"] == reason
    assert fragment in condition["message"]
    assert _status(cluster, bad)["phase"] == "Invalid"
    assert any(fragment in e["message"] for e in _events(cluster, reason, bad))
    assert _pods(cluster, bad) == []
    # The operator is still at work: a good run next to it gets its pods.
    cluster.apply(_run(good, {"url": (tmp_path / "box2").as_uri()}, nodes=1))
    wait_until(lambda: len(_pods(cluster, good)) == 1, "the good run's pod")


def test_missing_secret_and_unreachable_mailbox(operator: KubeCluster) -> None:
    cluster = operator
    cluster.apply(
        _run(
            "nosecret",
            {
                "endpoint": "http://127.0.0.1:9",
                "bucket": "b",
                "credentialsSecret": {"name": "absent"},
            },
        )
    )
    condition = wait_until(
        lambda: (
            (c := _condition(cluster, "nosecret", "MailboxReachable"))
            and c["reason"] == "SecretMissing"
            and c
        ),
        "SecretMissing",
    )
    assert "default/absent" in condition["message"]
    assert len(_events(cluster, "SecretMissing", "nosecret")) == 1
    # The pods exist and wait for their Secret (CreateContainerConfigError), as Kubernetes
    # has them do; the run is Pending, never Failed or regressed for it.
    wait_until(lambda: len(_pods(cluster, "nosecret")) == 3, "the pods, waiting")
    assert _status(cluster, "nosecret")["phase"] == "Pending"
    endpoint = f"http://127.0.0.1:{closed_port()}"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "some-keys", "namespace": "default"},
            "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "not-logged"},
        }
    )
    mailbox = {"endpoint": endpoint, "bucket": "b", "credentialsSecret": {"name": "some-keys"}}
    cluster.apply(_run("unreachable", mailbox, nodes=1))
    condition = wait_until(
        lambda: (
            (c := _condition(cluster, "unreachable", "MailboxReachable"))
            and c["status"] == "False"
            and c
        ),
        "MailboxReachable=False",
        timeout=RUN_TIMEOUT,
    )
    assert condition["reason"] == "MailboxUnreachable"
    assert endpoint in condition["message"]
    assert _events(cluster, "MailboxUnreachable", "unreachable")
    assert "not-logged" not in json.dumps(_get(cluster, "unreachable"))


def test_deletion_cascades_and_cleanup_deletes_the_prefix(
    operator: KubeCluster, tmp_path: Path
) -> None:

    cluster = operator
    base = (tmp_path / "box").as_uri()
    # Each run's node joins (its initial commits) and waits at the start barrier for a
    # second party that never comes: it is live, and would write, when its run is deleted.
    held = {"start": 2}
    cluster.apply(_run("keep", {"url": base}, nodes=1, barriers=held))
    cluster.apply(_run("wipe", {"url": base}, nodes=1, cleanupPolicy="Delete", barriers=held))
    urls = {}
    for name in ("keep", "wipe"):
        urls[name] = wait_until(
            # The initial commits are in (each fragment's newest round is known; no training
            # round commits while the node waits): the prefix holds a run.
            lambda n=name: (
                (s := _status(cluster, n)).get("newestRoundPerFragment") and s["mailbox"]
            ),
            f"{name}'s initial commits",
            timeout=RUN_TIMEOUT,
        )
    for name in ("keep", "wipe"):
        cluster.kubectl("delete", "gmr", name, "--wait=true", timeout=RUN_TIMEOUT)
    wait_until(lambda: _pods(cluster, "keep") == [] and _pods(cluster, "wipe") == [], "GC")
    kept = asyncio.run(gm.open_mailbox(urls["keep"]).list(""))
    wiped = asyncio.run(gm.open_mailbox(urls["wipe"]).list(""))
    assert "manifest.json" in kept, "cleanupPolicy Retain (the default) keeps the prefix"
    assert wiped == [], "cleanupPolicy Delete empties the run's prefix"


def test_a_hanging_store_does_not_delay_pod_replacement(operator: KubeCluster) -> None:
    """Status polls that never return (held to their budget, on threads of their own) leave
    the pod reconcile free: a killed node is replaced while the store hangs."""
    cluster = operator
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hang-keys", "namespace": "default"},
            "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "not-logged"},
        }
    )
    with stub_s3(lambda request: Reply(hang=True)) as s3:
        mailbox = {
            "endpoint": s3.endpoint_url,
            "bucket": "b",
            "credentialsSecret": {"name": "hang-keys"},
        }
        cluster.apply(_run("hang", mailbox, nodes=2))
        wait_until(
            lambda: (
                (c := _condition(cluster, "hang", "MailboxReachable"))
                and c["reason"] == "PollTimedOut"
            ),
            "the status to say the poll overran its budget",
            timeout=RUN_TIMEOUT,
        )
        before = wait_until(
            lambda: (
                len(p := _pods(cluster, "hang")) == 2
                and all(x["status"].get("phase") == "Running" for x in p)
                and {x["metadata"]["name"]: x["metadata"]["uid"] for x in p}
            ),
            "both nodes running",
            timeout=RUN_TIMEOUT,
        )
        cluster.kill("hang-node-1")
        wait_until(
            lambda: any(
                x["metadata"]["name"] == "hang-node-1"
                and x["metadata"]["uid"] != before["hang-node-1"]
                for x in _pods(cluster, "hang")
            ),
            "the killed node's replacement",
            timeout=RUN_TIMEOUT,
        )
        assert _events(cluster, "PodReplaced", "hang")
        assert "not-logged" not in json.dumps(_get(cluster, "hang"))


def test_a_run_name_too_long_for_a_label_gets_its_pods(
    operator: KubeCluster, tmp_path: Path
) -> None:
    from gradientmail_operator.render import run_label

    cluster = operator
    name = "a-run-whose-name-is-far-longer-than-the-sixty-three-characters-of-a-label"
    assert len(name) > 63
    # 20 steps: the run need only succeed (its pods found by the label and the annotation).
    algorithm = {"syncEvery": 10, "fragments": 2, "steps": 20, "roundTimeout": 2}
    cluster.apply(_run(name, {"url": (tmp_path / "box").as_uri()}, nodes=1, algorithm=algorithm))
    pods = wait_until(
        lambda: _pods(cluster, run_label(name)),
        "the pod of the long-named run",
        timeout=RUN_TIMEOUT,
    )
    assert pods[0]["metadata"]["annotations"]["gradientmail.dev/run-name"] == name
    final = wait_until(
        lambda: (s := _status(cluster, name)).get("phase") in ("Succeeded", "Failed") and s,
        "the long-named run to finish",
        timeout=RUN_TIMEOUT,
        every=0.5,
    )
    assert final["phase"] == "Succeeded", final
