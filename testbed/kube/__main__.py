"""``python -m testbed.kube``: the emulated cluster for hands-on use and for scripts.

Start the API server and the kubelet, write a kubeconfig, and either wait for Ctrl-C::

    .venv/bin/python -m testbed.kube --workdir /tmp/kube
    # in another shell:
    export KUBECONFIG=/tmp/kube/kubeconfig
    .venv/bin/kubectl apply -f tests/kube/sample_crd.yaml

or run one command against it and exit with that command's status (128+N when it died from
signal N; 125 when the cluster did not start; 126/127 when the command could not run)::

    .venv/bin/python -m testbed.kube -- .venv/bin/kubectl get ns

``--no-kubelet`` leaves pods Pending; ``--port`` fixes the port (default: a free one).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from testbed.kube.fixtures import start_cluster

EXIT_START_FAILED = 125


def _say(message: str) -> None:
    print(f"testbed.kube: {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed.kube",
        description="Run the emulated Kubernetes API server and local kubelet.",
    )
    parser.add_argument("--workdir", type=Path, help="state, logs, kubeconfig (default: temp)")
    parser.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    parser.add_argument("--namespace", default="default", help="the kubeconfig's namespace")
    parser.add_argument("--no-kubelet", action="store_true", help="do not run pods")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="[-- COMMAND ARGS...]")
    args = parser.parse_args(argv)
    command: list[str] = args.command
    if command and command[0] == "--":
        command = command[1:]

    temporary = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="gradientmail-kube-")) if temporary else args.workdir
    stop = threading.Event()

    def request_stop(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with ExitStack() as stack:
            try:
                cluster = stack.enter_context(
                    start_cluster(
                        workdir,
                        kubelet=not args.no_kubelet,
                        namespace=args.namespace,
                        server_options={"port": args.port},
                    )
                )
            except (OSError, RuntimeError) as exc:
                _say(f"could not start: {exc}")
                return EXIT_START_FAILED
            stack.callback(_say, "stopped")
            _say(f"API server {cluster.url}, kubelet {'off' if args.no_kubelet else 'on'}")
            _say(f"export KUBECONFIG={cluster.kubeconfig}")
            if command:
                return _run(command, cluster.env(), stop)
            _say("Ctrl-C to stop")
            with contextlib.suppress(KeyboardInterrupt):
                while not stop.wait(0.5):
                    pass
            return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if temporary:
            shutil.rmtree(workdir, ignore_errors=True)


def _run(command: list[str], env: dict[str, str], stop: threading.Event) -> int:
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        _say(f"command not found: {command[0]}")
        return 127
    except PermissionError:
        _say(f"command not executable: {command[0]}")
        return 126
    try:
        while True:
            try:
                status = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if stop.is_set():
                    child.terminate()
                    try:
                        status = child.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        status = child.wait()
                    break
    except KeyboardInterrupt:
        try:
            status = child.wait(timeout=5)  # Ctrl-C reached it through the terminal too
        except subprocess.TimeoutExpired:
            child.kill()
            status = child.wait()
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main())
