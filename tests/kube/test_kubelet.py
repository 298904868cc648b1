"""The local kubelet: pods run as processes, statuses and logs come back, deletion kills."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from testbed.kube.client import KubeApi, KubeApiError
from testbed.kube.fixtures import KubeCluster, start_cluster
from testbed.kube.kubelet import IMAGE_ENTRYPOINTS, image_repository
from testbed.processes import pid_alive
from tests.support.waiting import wait_until

Obj = dict[str, Any]
PODS = "/api/v1/namespaces/default/pods"


def pod(
    name: str,
    code: str,
    *,
    restart: str = "Never",
    env: list[Obj] | None = None,
    **spec: Any,
) -> Obj:
    container: Obj = {
        "name": "main",
        "image": "python:3.11-slim",
        "command": ["python", "-c", code],
    }
    if env is not None:
        container["env"] = env
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"restartPolicy": restart, "containers": [container], **spec},
    }


def phase(api: KubeApi, name: str) -> str | None:
    try:
        return str(api.get(f"{PODS}/{name}")["status"].get("phase"))
    except KubeApiError:
        return None


def wait_phase(api: KubeApi, name: str, wanted: str) -> Obj:
    wait_until(lambda: phase(api, name) == wanted, f"pod {name} to be {wanted}")
    result: Obj = api.get(f"{PODS}/{name}")
    return result


def test_a_pod_runs_to_completion_with_status_and_logs(kube_cluster: KubeCluster) -> None:
    api = kube_cluster.api
    api.create(PODS, pod("hello", "print('hello from the pod'); import sys; sys.exit(0)"))
    done = wait_phase(api, "hello", "Succeeded")
    assert done["spec"]["nodeName"] == "gradientmail-node"
    status = done["status"]
    assert status["startTime"]
    assert status["podIP"] == "127.0.0.1"
    (container,) = status["containerStatuses"]
    assert container["state"]["terminated"]["exitCode"] == 0
    assert container["state"]["terminated"]["reason"] == "Completed"
    assert container["restartCount"] == 0
    assert container["ready"] is False
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "False",
        "Ready": "False",
    }
    assert api.get(f"{PODS}/hello/log") == "hello from the pod\n"
    assert kube_cluster.kubelet is not None
    assert kube_cluster.kubelet.logs("default", "hello") == "hello from the pod\n"
    node = api.get("/api/v1/nodes/gradientmail-node")
    assert node["status"]["conditions"][0]["type"] == "Ready"


def test_failure_exit_code_and_running_state(kube_cluster: KubeCluster) -> None:
    api = kube_cluster.api
    api.create(PODS, pod("fails", "import sys; sys.exit(3)"))
    failed = wait_phase(api, "fails", "Failed")
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3
    assert terminated["reason"] == "Error"
    api.create(PODS, pod("runs", "import time; time.sleep(30)"))
    running = wait_phase(api, "runs", "Running")
    (status,) = running["status"]["containerStatuses"]
    assert status["ready"]
    assert "running" in status["state"]
    ready = {c["type"]: c["status"] for c in running["status"]["conditions"]}["Ready"]
    assert ready == "True"


def test_environment_from_values_secrets_config_maps_and_fields(kube_cluster: KubeCluster) -> None:
    api = kube_cluster.api
    env: list[Obj] = [
        {"name": "PLAIN", "value": "v"},
        {"name": "EXPANDED", "value": "$(PLAIN)-x"},
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
        {"name": "CONFIG", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": "MAYBE",
            "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k", "optional": True}},
        },
    ]
    code = (
        "import os; print(','.join(os.environ.get(k, '-') for k in "
        "['PLAIN','EXPANDED','SECRET','CONFIG','POD','MAYBE','FROM_mode','AWS_SECRET_ACCESS_KEY']))"
    )
    spec = pod("envy", code, env=env)
    spec["spec"]["containers"][0]["envFrom"] = [
        {"configMapRef": {"name": "settings"}, "prefix": "FROM_"}
    ]
    api.create(PODS, spec)
    waiting = wait_until(
        lambda: (
            (api.get(f"{PODS}/envy")["status"].get("containerStatuses") or [{}])[0]
            .get("state", {})
            .get("waiting", {})
            .get("reason")
            == "CreateContainerConfigError"
        ),
        "the missing secret to hold the container",
    )
    assert waiting
    api.create(
        "/api/v1/namespaces/default/secrets",
        {"metadata": {"name": "creds"}, "stringData": {"password": "hunter2"}},
    )
    api.create(
        "/api/v1/namespaces/default/configmaps",
        {"metadata": {"name": "settings"}, "data": {"mode": "fast"}},
    )
    wait_phase(api, "envy", "Succeeded")
    assert api.get(f"{PODS}/envy/log") == "v,v-x,hunter2,fast,envy,-,fast,-\n"


def test_kill_on_demand_and_deletion_kills_the_process(kube_cluster: KubeCluster) -> None:
    api, kubelet = kube_cluster.api, kube_cluster.kubelet
    assert kubelet is not None
    api.create(PODS, pod("victim", "import time; time.sleep(60)"))
    wait_phase(api, "victim", "Running")
    pid = kube_cluster.kill("victim")
    failed = wait_phase(api, "victim", "Failed")
    terminated = failed["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 137
    assert terminated["signal"] == signal.SIGKILL
    wait_until(lambda: not pid_alive(pid), "the killed process to be gone")

    api.create(PODS, pod("deleted", "import time; time.sleep(60)"))
    wait_phase(api, "deleted", "Running")
    running = kubelet.pid("default", "deleted")
    assert running is not None
    assert pid_alive(running)
    api.delete(f"{PODS}/deleted")
    wait_until(lambda: not api.exists(f"{PODS}/deleted"), "the deleted pod to go")
    assert not pid_alive(running)
    with pytest.raises(LookupError):
        kubelet.kill("default", "deleted")


def test_restart_on_failure_keeps_the_previous_log(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    api = kube_cluster.api
    counter = tmp_path / "attempts"
    code = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); "
        "n = int(p.read_text()) + 1 if p.exists() else 1; p.write_text(str(n)); "
        "print('attempt', n); sys.exit(0 if n >= 3 else 1)"
    )
    spec = pod("flaky", code, restart="OnFailure")
    spec["spec"]["containers"][0]["args"] = [str(counter)]
    api.create(PODS, spec)
    done = wait_phase(api, "flaky", "Succeeded")
    status = done["status"]["containerStatuses"][0]
    assert status["restartCount"] == 2
    assert status["lastState"]["terminated"]["exitCode"] == 1
    assert api.get(f"{PODS}/flaky/log") == "attempt 3\n"
    assert api.get(f"{PODS}/flaky/log", previous="true") == "attempt 2\n"


def test_init_containers_run_first(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    api = kube_cluster.api
    marker = tmp_path / "initialized"
    spec = pod("layered", f"import pathlib; print(pathlib.Path({str(marker)!r}).read_text())")
    spec["spec"]["initContainers"] = [
        {
            "name": "setup",
            "image": "python",
            "command": ["python", "-c", f"open({str(marker)!r}, 'w').write('ready')"],
        }
    ]
    api.create(PODS, spec)
    done = wait_phase(api, "layered", "Succeeded")
    assert done["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert api.get(f"{PODS}/layered/log") == "ready\n"


def test_image_entrypoints_and_unknown_images(tmp_path: Path) -> None:
    assert image_repository("ghcr.io/org/gradientmail:0.1@sha256:abc") == "gradientmail"
    assert IMAGE_ENTRYPOINTS["gradientmail"] == ((sys.executable, "-m", "gradientmail.cli"), ())
    echo = (sys.executable, "-c", "import sys; print(sys.argv[1:])")
    images = {"tool": (echo, ("default", "cmd"))}
    with start_cluster(tmp_path, kubelet_options={"images": images}) as cluster:
        api = cluster.api
        for name, extra in (("cmd", {}), ("args", {"args": ["given"]})):
            container = {"name": "c", "image": "registry.example/tool:1", **extra}
            spec = {"restartPolicy": "Never", "containers": [container]}
            api.create(PODS, {"metadata": {"name": name}, "spec": spec})
        wait_phase(api, "cmd", "Succeeded")
        wait_phase(api, "args", "Succeeded")
        assert api.get(f"{PODS}/cmd/log") == "['default', 'cmd']\n"  # ENTRYPOINT + CMD
        assert api.get(f"{PODS}/args/log") == "['given']\n"  # args replace CMD
        unknown = {
            "metadata": {"name": "mystery"},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "nginx:1"}]},
        }
        api.create(PODS, unknown)
        wait_until(
            lambda: (
                (api.get(f"{PODS}/mystery")["status"].get("containerStatuses") or [{}])[0]
                .get("state", {})
                .get("waiting", {})
                .get("reason")
                == "ErrImageNeverPull"
            ),
            "the unknown image to be reported",
        )


def test_bounded_in_pods_and_time(tmp_path: Path) -> None:
    with start_cluster(tmp_path, kubelet_options={"max_pods": 1}) as cluster:
        api = cluster.api
        api.create(PODS, pod("first", "import time; time.sleep(60)"))
        wait_phase(api, "first", "Running")
        api.create(PODS, pod("second", "print('second')"))
        wait_until(lambda: api.get(f"{PODS}/second")["spec"].get("nodeName"), "second bound")
        assert phase(api, "second") == "Pending"
        cluster.kill("first")
        wait_phase(api, "second", "Succeeded")

        api.create(PODS, pod("slow", "import time; time.sleep(60)", activeDeadlineSeconds=1))
        failed = wait_phase(api, "slow", "Failed")
        assert failed["status"]["reason"] == "DeadlineExceeded"


def test_stop_kills_every_process(tmp_path: Path) -> None:
    with start_cluster(tmp_path) as cluster:
        assert cluster.kubelet is not None
        for index in range(3):
            cluster.api.create(PODS, pod(f"p{index}", "import time; time.sleep(60)"))
        wait_until(lambda: len(cluster.kubelet.pids()) == 3 if cluster.kubelet else False, "3 pods")
        pids = cluster.kubelet.pids()
        cluster.kubelet.stop()
    assert not any(pid_alive(pid) for pid in pids)


def test_kubectl_logs(kube_cluster: KubeCluster) -> None:
    kube_cluster.api.create(PODS, pod("talker", "print('line 1'); print('line 2')"))
    wait_phase(kube_cluster.api, "talker", "Succeeded")
    assert kube_cluster.kubectl("logs", "talker").stdout == "line 1\nline 2\n"
    assert kube_cluster.kubectl("logs", "talker", "--tail=1").stdout == "line 2\n"
    slow = "import time; print('first', flush=True); time.sleep(1); print('second')"
    kube_cluster.api.create(PODS, pod("slow", slow))
    wait_phase(kube_cluster.api, "slow", "Running")
    followed = kube_cluster.kubectl("logs", "-f", "slow", timeout=30)  # ends with the container
    assert followed.stdout == "first\nsecond\n"
