"""``gradientmail run --procs-per-node P``: each node as P local ranks with torchrun's
environment and one learner id (a real gloo all_reduce among a node's ranks), one row per
node, rank 0's output in the node's log and ranks 1.. in their own; a rank that fails stops
its siblings and fails the node, which is restarted whole; the flag and the built-in node
refused with errors that name them."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli.test_cli import cli, cli_here
from tests.cli.test_cli_run import groups_gone, kill_groups, node_pgids

NODES = ("local-node-0", "local-node-1")

# Each rank checks its node's group: init_process_group from torchrun's variables, an
# all_reduce of rank + 1 over gloo (3.0 when the group is exactly the node's two ranks).
GLOO_RANK = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "GRADIENTMAIL_LEARNER_ID",
            "GRADIENTMAIL_NODE_INDEX", "OMP_NUM_THREADS")
    record = {k: os.environ.get(k) for k in keys}
    record |= {"sum": value.item(), "world": dist.get_world_size()}
    learner = os.environ["GRADIENTMAIL_LEARNER_ID"]
    (Path(sys.argv[1]) / f"{learner}.rank{rank}.json").write_text(json.dumps(record))
    print(f"rank {rank} of {learner}: step 1 loss {value.item()}", flush=True)
    dist.destroy_process_group()
    """
)

# No torch (cheap): every rank notes each start and the signal that stopped it; rank 1 of
# node 1 fails once its sibling has started (so the sibling is there to be stopped).
DYING_RANK = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    learner, rank = os.environ["GRADIENTMAIL_LEARNER_ID"], os.environ["RANK"]

    def lines(name):
        path = out / name
        return path.read_text().split() if path.exists() else []

    def stopped(signum, frame):
        with (out / f"{learner}.rank{rank}.stops").open("a") as f:
            f.write(signal.Signals(signum).name + "\\n")
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    with (out / f"{learner}.rank{rank}.starts").open("a") as f:
        f.write(os.environ["MASTER_PORT"] + "\\n")
    deadline = time.monotonic() + 120
    if learner.endswith("-node-1") and rank == "1":
        mine = len(lines(f"{learner}.rank1.starts"))
        while len(lines(f"{learner}.rank0.starts")) < mine and time.monotonic() < deadline:
            time.sleep(0.02)
        print("rank 1 gives up", flush=True)
        sys.exit(1)
    while time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def _run(tmp_path: Path, script: str, *flags: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    (tmp_path / "out").mkdir()
    (tmp_path / "rank.py").write_text(script)
    workdir = tmp_path / "run"
    done = cli(
        "run",
        *("--nodes", "2", "--procs-per-node", "2", *flags, "--workdir", workdir),
        *("--", "python", tmp_path / "rank.py", tmp_path / "out"),
        timeout=240,
    )
    if not groups_gone(workdir):
        kill_groups(node_pgids(workdir))
        pytest.fail("a rank outlived `gradientmail run`")
    return done, workdir


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    tmp_path = tmp_path_factory.mktemp("gloo")
    done, workdir = _run(tmp_path, GLOO_RANK, "--max-restarts", "0")
    return done, workdir, tmp_path / "out"


def test_each_node_runs_its_ranks_with_torchruns_environment(
    gloo_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    done, _, out = gloo_run
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 × 2 ranks × " in done.stdout
    ports = {}
    for index, learner in enumerate(NODES):
        records = [json.loads((out / f"{learner}.rank{r}.json").read_text()) for r in (0, 1)]
        for rank, record in enumerate(records):
            assert record["RANK"] == record["LOCAL_RANK"] == str(rank)
            assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == "2"
            assert (record["GROUP_RANK"], record["MASTER_ADDR"]) == ("0", "127.0.0.1")
            # Every rank is the node's one learner.
            assert record["GRADIENTMAIL_LEARNER_ID"] == learner
            assert record["GRADIENTMAIL_NODE_INDEX"] == str(index)
            assert record["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
            assert (record["world"], record["sum"]) == (2, 3.0)  # the node's ranks, no others
        assert records[0]["MASTER_PORT"] == records[1]["MASTER_PORT"]
        ports[learner] = records[0]["MASTER_PORT"]
    assert ports[NODES[0]] != ports[NODES[1]]


def test_rank_zero_drives_the_node_and_the_others_write_their_own_logs(
    gloo_run: tuple[subprocess.CompletedProcess[str], Path, Path],
) -> None:
    done, workdir, _ = gloo_run
    rows = [line for line in done.stdout.splitlines() if line.startswith(NODES)]
    assert [row.split()[0] for row in rows] == list(NODES), done.stdout  # one row per node
    for learner in NODES:
        assert f"rank 0 of {learner}: step 1 loss 3.0" in done.stdout
        assert f"rank 1 of {learner}" not in done.stdout
        assert f"rank 0 of {learner}" in (workdir / "logs" / f"{learner}.log").read_text()
        assert f"rank 1 of {learner}" in (workdir / "logs" / f"{learner}.rank1.log").read_text()
    resource = yaml.safe_load((workdir / "run.yaml").read_text())
    assert resource["spec"]["procsPerNode"] == 2
    nodes = json.loads((workdir / "nodes.json").read_text())
    assert [len(n["pids"]) for n in nodes] == [2, 2]


def test_a_failing_rank_stops_its_sibling_and_fails_its_node(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, DYING_RANK, "--max-restarts", "1", "--stop-timeout", "5")
    out = tmp_path / "out"
    assert done.returncode == 1, done.stdout + done.stderr
    assert "local-node-1 failed (exit 1 of rank 1) after 1 restarts" in done.stderr
    assert f"the last lines of {tmp_path / 'run/logs/local-node-1.rank1.log'}" in done.stderr
    assert "rank 1 gives up" in done.stderr

    def read(learner: str, rank: int, what: str) -> list[str]:
        return (out / f"{learner}.rank{rank}.{what}").read_text().split()

    # The failing node was restarted whole (both ranks), and each time its rank 0 was
    # stopped by its sibling's failure (SIGTERM), not by the run's end (SIGINT).
    assert [len(read("local-node-1", r, "starts")) for r in (0, 1)] == [2, 2]
    assert read("local-node-1", 0, "stops") == ["SIGTERM", "SIGTERM"]
    # The other node ran once and was stopped when the run failed.
    for rank in (0, 1):
        assert len(read("local-node-0", rank, "starts")) == 1
        assert read("local-node-0", rank, "stops") == ["SIGINT"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--procs-per-node", "0"), "--procs-per-node: spec.procsPerNode: must be an int >= 1"),
        (("--procs-per-node", "2"), "procsPerNode 2: the built-in node"),
    ],
)
def test_bad_procs_per_node_is_refused_before_anything_starts(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    done = cli_here("run", *args, "--workdir", tmp_path / "run")
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "run").exists()


def test_run_yaml_procs_per_node_is_checked_with_its_line(tmp_path: Path) -> None:
    spec = tmp_path / "run.yaml"
    spec.write_text("nodes: 2\nprocsPerNode: 1.5\n")
    done = cli_here("run", "-f", spec, "--workdir", tmp_path / "run", "--", "true")
    assert done.returncode == 2
    assert f"{spec}:2: spec.procsPerNode: must be an int >= 1 (got 1.5)" in done.stderr
