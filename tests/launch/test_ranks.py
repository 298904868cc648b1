"""The pod's launcher of a node's ranks, ``python -m gradientmail.launch.ranks --procs P --
COMMAND`` (what an operator pod of ``spec.procsPerNode`` P runs): torchrun's environment for
each rank with the pod's own variables unchanged, ranks 1.. in ``--logs``, the kubelet's
SIGTERM passed on to every rank, the node's exit code the ranks'. The ``gradientmail run``
side of the same class is tested in ``tests/cli/test_procs_per_node.py``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradientmail.launch.ranks import launcher_command, main, rank_environ
from tests.support.waiting import wait_until

# Each rank writes its environment, then waits (bounded) to be stopped, noting the signal.
RANK = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GRADIENTMAIL_LEARNER_ID")

    def stopped(signum, frame):
        (out / f"stopped{os.environ['RANK']}").write_text(signal.Signals(signum).name)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    record = {k: os.environ.get(k) for k in keys}
    (out / f"env{os.environ['RANK']}.json").write_text(json.dumps(record))
    print("rank", os.environ["RANK"], "ready", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def test_the_pod_launcher_starts_ranks_and_passes_sigterm_on(tmp_path: Path) -> None:
    (tmp_path / "rank.py").write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, str(tmp_path / "rank.py"), str(out)]
    launcher = subprocess.Popen(
        [*launcher_command(2, command)[:5], "--logs", str(tmp_path / "logs"), "--", *command],
        env={"GRADIENTMAIL_LEARNER_ID": "exp-node-3", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: len(list(out.glob("env*.json"))) == 2, "both ranks started")
        launcher.send_signal(signal.SIGTERM)  # the kubelet signals the container's first process
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, output
    records = [json.loads((out / f"env{r}.json").read_text()) for r in (0, 1)]
    assert records[0]["MASTER_PORT"] == records[1]["MASTER_PORT"]
    for rank, record in enumerate(records):
        torchrun = rank_environ(rank, 2, int(record["MASTER_PORT"]))
        expected = {k: v for k, v in torchrun.items() if k in record}
        assert record == expected | {"GRADIENTMAIL_LEARNER_ID": "exp-node-3"}  # the pod's own
        assert (out / f"stopped{rank}").read_text() == "SIGTERM"
    assert "rank 0 ready" in output
    assert "rank 1 ready" not in output  # in its own log
    assert "rank 1 ready" in (tmp_path / "logs" / "rank1.log").read_text()


def test_rank_environ_is_torchruns() -> None:
    torchrun = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert rank_environ(1, 4, 29500).items() >= torchrun.items()


@pytest.mark.parametrize(
    ("command", "python"),
    [
        (["python", "-m", "trainer"], "python"),
        (["/opt/venv/bin/python3", "train.py"], "/opt/venv/bin/python3"),
        (["torch-app", "--fast"], "python"),
    ],
)
def test_the_launcher_runs_under_the_commands_interpreter(command: list[str], python: str) -> None:
    assert launcher_command(3, command) == [
        python,
        "-m",
        "gradientmail.launch.ranks",
        "--procs",
        "3",
        "--",
        *command,
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--procs", "0", "--", "true"], "--procs 0: must be an int >= 1"),
        (["--procs", "2"], "give the command after --"),
    ],
)
def test_the_launcher_refuses_bad_arguments(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
