"""Learners made of many ranks (``session/_ranks.py``): gloo on CPU, each rank a process
forked from this (already imported) test process, on a ``file://`` mailbox.

- one shared run of ``examples/snippets/ddp_node.py`` (the README's DDP snippet, run as it
  is): learners ``a`` and ``b`` of 2 DDP ranks each and ``c`` of 1 rank; the ranks of a
  learner end bitwise identical and equal to the newest commits, the three learners
  commit every round together, the followers never talk to the mailbox, and a learner's
  samples are its ranks' sum;
- a rank that dies: learner ``d``'s rank 1 exits mid-run; ``d``'s leader raises
  ``RanksFailed`` from its next ``step()`` and leaves, and learner ``e`` goes on committing
  rounds without it;
- refusals: what rank 0's join raises is raised on every rank (a model not the run's), and
  a sharded model (FSDP2, DTensor parameters) is refused until supported.

Every wait is bounded (process joins, the process group's timeout, step counts).
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import runpy
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import gradientmail as gm
from gradientmail import RanksFailed
from gradientmail.events import Following, Left
from gradientmail.launch.env import NodeEnv
from gradientmail.launch.ranks import free_port, rank_environ
from gradientmail.patterns.barrier import Barrier
from tests.support.waiting import TEST_TIMEOUT
from tests.training import commits

REPO = Path(__file__).resolve().parents[2]
SNIPPET = REPO / "examples" / "snippets" / "ddp_node.py"
STEPS = 12  # the snippet's steps: sync_every 4 over 2 fragments, 6 rounds per learner
RUN_LIMIT = max(TEST_TIMEOUT, 120.0)  # seconds for a whole multi-process run
DEATH_STEP = 6  # learner d's rank 1 exits after this many steps

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"
)


@pytest.fixture(scope="module", autouse=True)
def _optimizers_imported() -> None:
    """The first optimizer a process makes imports torch._dynamo (~800 modules, seconds of
    CPU): made here once, before the ranks fork, instead of once in every rank."""
    torch.optim.SGD(_model().parameters(), lr=0.1)


def _model() -> torch.nn.Module:
    # The snippet's model, for loading the newest commits into.
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _child(out: Path, environ: dict[str, str], body: Callable[[], dict[str, Any]]) -> None:
    """A rank: its environment, then ``body``; what it returns (tensors as safetensors,
    the rest as JSON), or the error it raised, goes to ``out``."""
    os.environ.update(environ)
    torch.set_num_threads(1)
    result: dict[str, Any]
    try:
        result = body()
    except BaseException as exc:
        result = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    tensors = result.pop("tensors", None)
    if tensors is not None:
        save_file(tensors, str(out.with_suffix(".safetensors")))
    out.write_text(json.dumps(result))
    os._exit(0)  # no atexit of the parent's (pytest's) in a forked child


Children = dict[str, tuple[dict[str, str], Callable[[], dict[str, Any]]]]


def _run(children: Children, where: Path) -> dict[str, dict[str, Any]]:
    """Fork every child, wait for all (bounded), return each one's result (a child that
    died without one: ``error`` "died")."""
    fork = multiprocessing.get_context("fork")
    procs = {
        name: fork.Process(target=_child, args=(where / f"{name}.json", env, body), daemon=True)
        for name, (env, body) in children.items()
    }
    try:
        for proc in procs.values():
            proc.start()
        for name, proc in procs.items():
            proc.join(RUN_LIMIT)
            assert proc.exitcode is not None, f"rank {name} still runs after {RUN_LIMIT:.0f} s"
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    results: dict[str, dict[str, Any]] = {}
    for name in procs:
        path = where / f"{name}.json"
        if not path.exists():
            results[name] = {"error": "died", "trace": f"exit code {procs[name].exitcode}"}
            continue
        results[name] = json.loads(path.read_text())
        tensors = path.with_suffix(".safetensors")
        if tensors.exists():
            results[name]["tensors"] = load_file(str(tensors))
    return results


def _snippet() -> dict[str, Any]:
    """One rank of the snippet, then what it ended with."""
    ran = runpy.run_path(str(SNIPPET), run_name="__main__")
    session: gm.Session = ran["session"]
    following = [e for e in session.events if isinstance(e, Following)]
    return {
        "tensors": {k: v.detach().clone() for k, v in ran["model"].module.state_dict().items()},
        "rounds": list(session.rounds),
        "steps": session.steps,
        "learner": session.learner_id,
        "rank": session.rank,
        "requests": sum(session.counters().requests.values()),
        "following": [(e.rank, e.ranks) for e in following],
    }


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[gm.Mailbox, dict]:
    where = tmp_path_factory.mktemp("ddp")
    url = (where / "mailbox").as_uri()
    sizes = {"a": 2, "b": 2, "c": 1}
    children = {}
    for index, (learner, size) in enumerate(sizes.items()):
        node = NodeEnv(
            mailbox=url,
            learner_id=learner,
            node_index=index,
            nodes=len(sizes),
            sync_every=4,
            fragments=2,
            steps=STEPS,
            round_timeout=RUN_LIMIT / 2,  # rounds wait for every learner, even when loaded
        ).to_environ()
        port = free_port()
        for rank in range(size):
            children[f"{learner}{rank}"] = ({**node, **rank_environ(rank, size, port)}, _snippet)
    results = _run(children, where)
    for name, result in results.items():
        assert "error" not in result, f"rank {name}: {result.get('trace')}"
    return gm.open_mailbox(url), results


def _same(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8))
        for k in x
    )


def test_the_ranks_of_each_learner_end_bitwise_identical_and_on_the_newest_commits(
    ddp_run: tuple[gm.Mailbox, dict],
) -> None:
    box, results = ddp_run
    newest = _model()
    gm.align(newest, mailbox=box)
    run = newest.state_dict()
    for name, result in results.items():
        assert result["steps"] == STEPS, name
        assert _same(result["tensors"], run), f"rank {name} differs from the newest commits"
    # The rounds applied are the leader's on every rank.
    assert results["a1"]["rounds"] == results["a0"]["rounds"] == results["c0"]["rounds"]


def test_a_learner_of_two_ranks_and_one_of_one_commit_every_round_together(
    ddp_run: tuple[gm.Mailbox, dict],
) -> None:
    box, _ = ddp_run
    training = [c for c in commits(box) if c.contributors]
    # Every sync point of every learner (STEPS / 2 of them, fragments staggered, and the
    # close's) is one round with all three: one learner per node, whatever its ranks.
    assert len(training) >= STEPS // 2, training
    for commit in training:
        samples = {x.learner: x.samples for x in commit.contributors}
        assert samples.keys() == {"a", "b", "c"}, commit
        # A learner's samples are its ranks' sum: 2 ranks of 16 per step, against 1.
        assert samples["a"] == samples["b"] == 2 * samples["c"], commit


def test_only_the_leader_talks_to_the_mailbox_the_others_follow(
    ddp_run: tuple[gm.Mailbox, dict],
) -> None:
    _, results = ddp_run
    for learner in ("a", "b"):
        leader, follower = results[f"{learner}0"], results[f"{learner}1"]
        assert leader["learner"] == follower["learner"] == learner
        assert (leader["rank"], follower["rank"]) == (0, 1)
        assert leader["requests"] > 0, leader
        assert follower["requests"] == 0, follower
        assert leader["following"] == []
        assert follower["following"] == [[1, 2]]
    assert results["c0"]["following"] == []
    assert results["c0"]["rank"] == 0


# -- a rank that dies -----------------------------------------------------------------------


def _options(learner: str, url: str) -> dict[str, Any]:
    # Rounds wait for every live learner (round_timeout is only a bound): a round without
    # d is one after d left.
    return {
        "algorithm": gm.DiLoCo(sync_every=2, fragments=1),
        "mailbox": gm.open_mailbox(url),
        "learner_id": learner,
        "round_timeout": RUN_LIMIT / 4,
        "lease_timeout": 5.0,
        "poll_interval": 0.05,
    }


def _start(url: str, learner: str) -> None:
    Barrier(mailbox=gm.open_mailbox(url), learner_id=learner, poll_interval=0.05).wait(
        "start", parties=2, timeout=RUN_LIMIT / 2
    )


def _alone_after_together(box: gm.Mailbox) -> tuple[list[int], list[int]]:
    """Rounds d and e committed together, and rounds e committed alone after those."""
    found = commits(box)
    together = [c.round for c in found if {x.learner for x in c.contributors} == {"d", "e"}]
    alone = [
        c.round
        for c in found
        if [x.learner for x in c.contributors] == ["e"] and c.round > max(together, default=-1)
    ]
    return together, alone


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def _dying_rank(url: str) -> dict[str, Any]:
    """Learner d, one of its two ranks: no DDP (both ranks take the same steps on the same
    data), so what notices the dead rank is the Session. Rank 1 exits after DEATH_STEP."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RUN_LIMIT / 2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    session = gm.Session(model, **_options("d", url))
    if rank == 0:
        _start(url, "d")
    steps = 0
    try:
        for step in range(10 * DEATH_STEP):
            if rank == 1 and step == DEATH_STEP:
                os._exit(0)  # dies: no close, no collective
            _train_step(model, optimizer, step)
            session.step(samples=4)
            steps += 1
    except RanksFailed as exc:
        left = [e.clean for e in session.events if isinstance(e, Left)]
        return {"error": "RanksFailed", "message": str(exc), "steps": steps, "left": left}
    return {"steps": steps}


def _surviving_learner(url: str) -> dict[str, Any]:
    """Learner e: trains until two rounds committed without d, after rounds with d."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    box = gm.open_mailbox(url)
    with gm.Session(model, **_options("e", url)) as session:
        _start(url, "e")
        for step in range(400):
            _train_step(model, optimizer, step)
            session.step(samples=4)
            together, alone = _alone_after_together(box)
            if together and len(alone) >= 2:
                break
    return {"steps": session.steps}


def test_a_rank_that_dies_takes_its_learner_out_and_the_others_go_on(tmp_path: Path) -> None:
    url = (tmp_path / "mailbox").as_uri()
    port = free_port()
    children: Children = {
        f"d{rank}": (rank_environ(rank, 2, port), lambda: _dying_rank(url)) for rank in range(2)
    }
    children["e0"] = ({}, lambda: _surviving_learner(url))
    results = _run(children, tmp_path)
    leader = results["d0"]
    # The leader notices at its first step without rank 1, raises from step(), and leaves.
    assert leader.get("error") == "RanksFailed", leader
    assert leader["steps"] == DEATH_STEP, leader
    assert leader["left"] == [False], leader
    assert "error" not in results["e0"], results["e0"]
    together, alone = _alone_after_together(gm.open_mailbox(url))
    assert together, alone
    assert len(alone) >= 2, (together, alone)


# -- refusals -------------------------------------------------------------------------------


def _refused_rank(url: str) -> dict[str, Any]:
    """A rank of learner f, whose model is not the run's: rank 0's join is refused."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RUN_LIMIT / 2))
    gm.Session(_model(), **_options("f", url))
    return {}


def _sharded_rank() -> dict[str, Any]:
    """A rank of a learner whose parameters are DTensors (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=RUN_LIMIT / 2))
    model = _model()
    fully_shard(model)
    gm.Session(model, **_options("g", (Path(os.environ["G_MAILBOX"])).as_uri()))
    return {}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    where = tmp_path_factory.mktemp("refusals")
    url = (where / "mailbox").as_uri()
    # The run's model is another one than f's.
    gm.Session(torch.nn.Linear(8, 1), **_options("x", url)).close()
    port, sharded = free_port(), free_port()
    children: Children = {
        f"f{rank}": (rank_environ(rank, 2, port), lambda: _refused_rank(url)) for rank in range(2)
    }
    g_env = {**rank_environ(0, 1, sharded), "G_MAILBOX": str(where / "g")}
    children["g0"] = (g_env, _sharded_rank)
    return _run(children, where)


def test_what_rank_0_raises_at_join_is_raised_on_every_rank(
    refusals: dict[str, dict[str, Any]],
) -> None:
    leader, follower = refusals["f0"], refusals["f1"]
    assert leader["error"] == follower["error"] == "ProtocolError", (leader, follower)
    assert "does not match the run" in leader["message"], leader
    # The follower never read the run: it raises what rank 0 found, saying so.
    assert follower["message"].startswith("joining failed on rank 0"), follower
    assert leader["message"] in follower["message"], follower


def test_a_sharded_fsdp2_model_is_refused_until_supported(
    refusals: dict[str, dict[str, Any]],
) -> None:
    result = refusals["g0"]
    assert result["error"] == "NotImplementedError", result
    assert "DTensor" in result["message"], result
