"""The node environment contract and the built-in node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import gradientmail as gm
from gradientmail.launch.env import NodeEnv, NodeEnvError
from tests.training import commits


def test_environment_round_trips() -> None:
    env = NodeEnv(
        mailbox="s3://b/run-1?endpoint=http://127.0.0.1:9000",
        learner_id="run-1-node-2",
        node_index=2,
        nodes=3,
        barriers={"start": 3, "done": 2},
        sync_every=50,
        fragments=4,
        outer_lr=0.5,
        outer_momentum=0.8,
        quorum=2,
        round_timeout=7.5,
        steps=300,
    )
    wire = env.to_environ()
    assert all(k.startswith("GRADIENTMAIL_") and isinstance(v, str) for k, v in wire.items())
    assert NodeEnv.from_environ(wire) == env
    assert env.parties("done") == 2
    assert env.parties("epoch-1") == 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"GRADIENTMAIL_MAILBOX": ""}, "GRADIENTMAIL_MAILBOX is not set"),
        ({"GRADIENTMAIL_NODES": "three"}, "GRADIENTMAIL_NODES='three' is not a int"),
        ({"GRADIENTMAIL_NODE_INDEX": "3"}, "node index 3 is not within 0..2"),
        ({"GRADIENTMAIL_BARRIERS": "start=0"}, "GRADIENTMAIL_BARRIERS: 'start=0'"),
        ({"GRADIENTMAIL_BARRIERS": "a/b=2"}, "barrier name 'a/b' contains '/'"),
        ({"GRADIENTMAIL_LEARNER_ID": "no/slash"}, "not a valid key segment"),
        ({"GRADIENTMAIL_ROUND_TIMEOUT": "soon"}, "is not a float"),
    ],
)
def test_bad_environment_names_the_variable(change: dict[str, str], message: str) -> None:
    wire = NodeEnv(mailbox="file:///tmp/x", learner_id="n0", nodes=3).to_environ() | change
    with pytest.raises(NodeEnvError, match=message):
        NodeEnv.from_environ(wire)


def test_builtin_nodes_train_together(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTMAIL_")}
    procs = []
    for index in range(2):
        env = NodeEnv(
            mailbox=(tmp_path / "box").as_uri(),
            learner_id=f"node-{index}",
            node_index=index,
            nodes=2,
            barriers={"start": 2, "done": 2},
            sync_every=10,
            fragments=2,
            round_timeout=2.0,
            steps=60,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "gradientmail.demo.node"],
                env=base | env.to_environ() | {"GRADIENTMAIL_TASK": "synthetic"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=180)
            outputs.append(out)
            assert proc.returncode == 0, out
    finally:
        for proc in procs:
            proc.kill()
    assert all("step 60 loss" in out for out in outputs)
    box = gm.FileMailbox(tmp_path / "box")
    training = [c for c in commits(box) if c.round >= 2]
    # The built-in node trains at full speed, so how many due steps find their fragment's
    # previous round still open depends on the machine; both nodes must have contributed.
    assert len(training) >= 2
    assert {x.learner for c in training for x in c.contributors} == {"node-0", "node-1"}


@pytest.mark.parametrize("module", ["gradientmail.demo.node", "gradientmail.node"])
def test_builtin_node_without_environment_says_what_is_missing(module: str) -> None:
    """The built-in node, and its old path (pods and images that still name it)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GRADIENTMAIL_")}
    done = subprocess.run(
        [sys.executable, "-m", module],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "gradientmail.demo.node: " in done.stderr
    assert "GRADIENTMAIL_MAILBOX is not set" in done.stderr
