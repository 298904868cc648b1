"""The read-only view and the ``gradientmail`` tools on a Moshpit run: ``inspect`` (group
rounds, sizes, the spread of learners' versions), ``status --json``, ``verify`` (every group
commit recomputed; a corrupted one caught), ``align`` (the average of the newest group
commits, and which) and ``sweep`` (old group rounds deleted, the newest kept).

The run is real: four learners as threads, each a Session on one file mailbox, on a 2 × 2
grid (``Moshpit(sync_every=1, group_size=2, grid_dims=2)``), so every group round has two
groups of two. The commands run in this process (``gradientmail.cli.main``), their output
captured.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.cli import main
from gradientmail.demo.report import curve_notes, run_algorithm
from gradientmail.events import Counters
from gradientmail.inspect import GroupsView, RunView, RunWatcher, inspect_run
from gradientmail.mailbox.metered import Metered
from gradientmail.payload import get_tensors
from tests.inspect.test_inspect import Run
from tests.support.waiting import TEST_TIMEOUT

LEARNERS = 4
M, D = 2, 2
STEPS = 4  # group rounds 1..4: every learner syncs at every step


@dataclass(frozen=True)
class MoshpitRun:
    box: gm.FileMailbox
    url: str
    models: dict[str, torch.nn.Module]
    steps: int


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def train_moshpit(
    root: Path, steps: int = STEPS, keep_rounds: int = 10_000, learn: bool = True
) -> MoshpitRun:
    """Four learners, ``steps`` steps each of a tiny regression, a group round at each.
    Every round waits for its expected members (round_timeout and lease_timeout are
    bounds only a failure reaches), so every group has both of its members. Without
    ``learn`` learner ``i`` starts from parameters all ``i`` and never trains, with equal
    weights: after ``D`` rounds every learner holds the exact global average."""
    box = gm.FileMailbox(root)
    algorithm = gm.Moshpit(sync_every=1, group_size=M, grid_dims=D)
    models = {f"l{i}": _model(0) for i in range(LEARNERS)}
    errors: list[BaseException] = []
    start = threading.Barrier(LEARNERS, timeout=TEST_TIMEOUT)

    def learner(i: int) -> None:
        name = f"l{i}"
        model = models[name]
        generator = torch.Generator().manual_seed(100 + i)
        try:
            session = gm.Session(
                model,
                algorithm=algorithm,
                mailbox=box,
                learner_id=name,
                round_timeout=TEST_TIMEOUT,
                lease_timeout=TEST_TIMEOUT,
                poll_interval=0.02,
                keep_rounds=keep_rounds,
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            start.wait()
            if not learn:
                with torch.no_grad():
                    for param in model.parameters():
                        param.fill_(float(i))
            for _ in range(steps):
                if not learn:
                    session.step(samples=8)
                    continue
                x = torch.randn(8, 3, generator=generator)
                loss = (model(x) - x[:, :2] * (i + 1)).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                session.step(samples=8 * (i + 1))  # unequal weights: a weighted average
            session.close()
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=learner, args=(i,)) for i in range(LEARNERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * TEST_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a learner did not finish"
    assert not errors, errors
    return MoshpitRun(box, box.url, models, steps)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> MoshpitRun:
    return train_moshpit(tmp_path_factory.mktemp("moshpit") / "box")


def keys(box: gm.Mailbox, prefix: str) -> list[str]:
    return list(asyncio.run(box.list(prefix)))


def group_rounds(box: gm.Mailbox) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for key in keys(box, p.GROUP_ROUNDS):
        t, group = p.parse_group_round_key(key)
        found.setdefault(t, []).append(group)
    return found


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_shows_group_rounds(run: MoshpitRun) -> None:
    view: RunView = asyncio.run(inspect_run(run.box))
    stored = group_rounds(run.box)
    newest = max(stored)
    assert newest == run.steps  # one group round per step
    groups = view.groups
    assert isinstance(groups, GroupsView)
    assert (groups.group_size, groups.grid_dims, groups.slots) == (M, D, LEARNERS)
    assert groups.newest_round == newest
    assert view.rounds_committed == newest
    assert view.newest_round == newest
    assert [r.round for r in groups.rounds] == list(range(newest - 3, newest + 1))
    for shown in groups.rounds:
        assert shown.groups == len(stored[shown.round]) == LEARNERS // M
        assert shown.sizes == (M, M)
        assert (shown.min_size, shown.median_size, shown.max_size) == (M, M, M)
        assert shown.learners == LEARNERS
    assert sorted(view.last_contributors) == [f"l{i}" for i in range(LEARNERS)]
    assert dict(groups.versions) == {f"l{i}": newest for i in range(LEARNERS)}
    assert groups.open_groups == {}
    # Every learner left: no live learner has a version to spread over.
    assert view.live_learners == 0
    assert groups.spread is None
    assert groups.describe() == f"round {newest}, 2 groups of 2, versions spread —"
    # The samples the learners trained, from their beats.
    assert view.samples_committed == sum(8 * (i + 1) * run.steps for i in range(LEARNERS))


# -- the commands ----------------------------------------------------------------------------


def gm_cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``gradientmail ARGS`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_status_shows_the_group_rounds(run: MoshpitRun, capsys: pytest.CaptureFixture[str]) -> None:
    newest = max(group_rounds(run.box))
    status, stdout, stderr = gm_cli(capsys, "status", run.url, "--json")
    assert status == 0, stderr
    shown = json.loads(stdout)
    assert shown["rounds_committed"] == shown["newest_round"] == newest
    groups = shown["groups"]
    assert groups["newest_round"] == newest
    assert (groups["group_size"], groups["grid_dims"], groups["slots"]) == (M, D, LEARNERS)
    assert [r["round"] for r in groups["rounds"]] == list(range(newest - 3, newest + 1))
    assert groups["rounds"][-1] == {
        "round": newest,
        "groups": 2,
        "sizes": [2, 2],
        "min_size": 2,
        "median_size": 2.0,
        "max_size": 2,
        "learners": LEARNERS,
        "samples": sum(8 * (i + 1) for i in range(LEARNERS)),  # one step each
    }
    assert groups["versions"] == {f"l{i}": newest for i in range(LEARNERS)}
    assert groups["version_spread"] is None  # no learner is live any more
    assert groups["summary"] == f"round {newest}, 2 groups of 2, versions spread —"
    status, stdout, stderr = gm_cli(capsys, "status", run.url)
    assert status == 0, stderr
    assert f"group round {newest}" in stdout
    assert f"groups: round {newest}, 2 groups of 2" in stdout
    assert "grid 2×2 (4 slots)" in stdout
    assert "group round" in stdout.splitlines()[-LEARNERS - 1]  # the learners' column


def group_counts(stdout: str) -> tuple[int, int, int, int]:
    """``verify``'s group summary: (group commits, verified, unverifiable, mismatched)."""
    found = re.search(
        r"(\d+) group commits: (\d+) verified, (\d+) no longer verifiable, (\d+) mismatched",
        stdout,
    )
    assert found is not None, stdout
    total, verified, unverifiable, mismatched = map(int, found.groups())
    return total, verified, unverifiable, mismatched


def test_verify_recomputes_every_group_commit(
    run: MoshpitRun, capsys: pytest.CaptureFixture[str]
) -> None:
    stored = sum(len(g) for g in group_rounds(run.box).values())
    status, stdout, stderr = gm_cli(capsys, "verify", run.url, "-v")
    assert status == 0, stdout + stderr
    assert group_counts(stdout) == (stored, stored, 0, 0)
    assert "1 commits: 1 verified" in stdout  # the initial commit (rounds/)
    assert len(re.findall(r"group round +\d+  group \S+  l\d\+l\d  OK", stdout)) == stored


def copy_of(run: MoshpitRun, target: Path) -> gm.FileMailbox:
    """The run's mailbox copied (a test that changes it leaves the shared run alone)."""
    shutil.copytree(run.box.root, target)
    return gm.FileMailbox(target)


def read_commit(box: gm.Mailbox, key: str) -> p.Commit:
    return p.decode_commit(key, asyncio.run(box.get(key)))


def corrupt(box: gm.FileMailbox, key: str) -> None:
    """Overwrite a stored object's bytes in place (same length, one byte changed)."""
    path = box.root / "objects" / key
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["member", "params"])
def test_verify_catches_a_corrupted_group_commit(
    run: MoshpitRun, tmp_path: Path, capsys: pytest.CaptureFixture[str], which: str
) -> None:
    box = copy_of(run, tmp_path / "box")
    stored = sum(len(g) for g in group_rounds(box).values())
    key = p.group_round_key(2, group_rounds(box)[2][0])
    commit = read_commit(box, key)
    victim = commit.contributors[0].payload if which == "member" else commit.params
    corrupt(box, victim)
    status, stdout, stderr = gm_cli(capsys, "verify", box.url)
    assert status == 1, stdout + stderr
    assert group_counts(stdout) == (stored, stored - 1, 0, 1)
    t, group = p.parse_group_round_key(key)
    assert f"MISMATCH group round {t} group {group}: " in stderr


def test_align_writes_the_average_of_the_newest_group_commits(
    run: MoshpitRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    from gradientmail.engine.align import describe_alignment

    target = tmp_path / "model.safetensors"
    status, stdout, stderr = gm_cli(capsys, "align", run.url, "--out", target)
    assert status == 0, stdout + stderr
    newest = max(group_rounds(run.box))
    commits = [
        read_commit(run.box, p.group_round_key(newest, g)) for g in group_rounds(run.box)[newest]
    ]
    said = describe_alignment(commits)
    assert f"group round {newest}" in said
    assert said in stdout
    # What the library's align loads into the model, tensor for tensor.
    model = _model(1)
    assert gm.align(model, mailbox=run.box) == {0: newest}
    with safe_open(str(target), framework="pt") as f:
        assert sorted(f.keys()) == sorted(name for name, _ in model.named_parameters())
        for name, param in model.named_parameters():
            assert f.get_tensor(name).equal(param.detach()), name
        metadata = f.metadata()
    assert json.loads(metadata["gradientmail.rounds"]) == {"0": newest}
    assert metadata["gradientmail.aligned"] == said
    assert json.loads(metadata["gradientmail.groups"]) == sorted(c.group or "" for c in commits)
    # The weighted average of the newest round's group commits, by hand.
    total = sum(c.samples for c in commits)
    with safe_open(str(target), framework="pt") as f:
        for name, _ in model.named_parameters():
            expected = torch.stack(
                [
                    asyncio.run(get_tensors(run.box, c.params))[name] * (c.samples / total)
                    for c in commits
                ]
            ).sum(0)
            assert torch.allclose(f.get_tensor(name), expected, atol=1e-6), name


def test_sweep_deletes_old_group_rounds_and_keeps_the_newest(
    run: MoshpitRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    box = copy_of(run, tmp_path / "box")
    newest = max(group_rounds(box))
    kept_rounds = {newest - 1, newest}
    before = keys(box, "")
    # What the kept rounds' records name, and what only the older rounds' name.
    named_kept: set[str] = set()
    named_old: set[str] = set()
    for t, groups in group_rounds(box).items():
        for group in groups:
            commit = read_commit(box, p.group_round_key(t, group))
            named = {commit.params, *(c.payload for c in commit.contributors)}
            (named_kept if t in kept_rounds else named_old).update(named)
    initial = read_commit(box, p.round_key(0)).params
    assert named_old - named_kept  # the older rounds' payloads are there to sweep

    status, stdout, stderr = gm_cli(capsys, "sweep", box.url, "--yes", "--keep-rounds", "2")
    assert status == 0, stdout + stderr
    assert f"group rounds 1–{newest - 2} go whole" in stdout
    after = set(keys(box, ""))
    assert set(group_rounds(box)) == kept_rounds
    for prefix in (p.GROUP_SNAPSHOTS, p.GROUP_CLAIMS):
        rounds = {p.group_round_of(k) for k in keys(box, prefix)}
        assert rounds == kept_rounds, prefix
    assert named_kept | {initial} <= after  # every kept record's payloads stay
    assert not (named_old - named_kept) & after  # the rest are gone
    assert p.round_key(0) in after
    assert p.MANIFEST in after
    assert len(after) < len(before)
    # The newest group rounds still verify; the swept ones are no longer listed.
    status, stdout, stderr = gm_cli(capsys, "verify", box.url)
    assert status == 0, stdout + stderr
    assert group_counts(stdout) == (4, 4, 0, 0)
    # Nothing more to sweep, and align still loads the newest round.
    status, stdout, _ = gm_cli(capsys, "sweep", box.url, "--yes", "--keep-rounds", "2")
    assert status == 0
    assert "nothing to sweep" in stdout, stdout
    status, stdout, stderr = gm_cli(capsys, "align", box.url, "--out", tmp_path / "m.st")
    assert status == 0, stdout + stderr
    assert f"group round {newest}" in stdout


def test_sweep_asks_first(
    run: MoshpitRun,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    box = copy_of(run, tmp_path / "box")
    before = keys(box, "")
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    status, stdout, stderr = gm_cli(capsys, "sweep", box.url)
    assert status == 1
    assert "group commits" in stdout
    assert "group snapshots" in stdout
    assert "nothing deleted" in stderr
    assert keys(box, "") == before


# -- the view from records written by hand: sizes that differ, live learners, reads --------


class GroupRun:
    """A Moshpit run's records written straight into a mailbox, as its learners would."""

    def __init__(self) -> None:
        self.counters = Counters()
        self.raw = gm.MemoryMailbox()
        self.box = Metered(self.raw, self.counters, threading.Lock())
        self.published: set[str] = set()
        specs = ((p.TensorSpec("w", (4, 2), "float32"),),)
        algorithm = gm.Moshpit(sync_every=1, group_size=4, grid_dims=2).settings()
        self.put(p.CREATOR, p.encode(p.CreatorClaim("l0")))
        self.put(p.MANIFEST, p.encode(p.Manifest("l0", algorithm, specs)))
        initial = p.Commit(0, 0, None, (), sha("initial"), None, "l0")
        self.put(p.round_key(0), p.encode(initial))

    def put(self, key: str, data: bytes) -> None:
        assert asyncio.run(self.raw.put_if_absent(key, data))

    def slot(self, slot: int, learner: str) -> None:
        self.put(p.grid_key(slot), p.encode(p.Claim(learner)))

    def beat(self, learner: str, n: int, samples: int) -> None:
        self.put(p.beat_key(learner, n), p.encode(p.Beat(learner, samples // 8, samples, False)))

    def snapshot(self, t: int, group: str, learner: str) -> None:
        self.published.add(p.group_snapshot_key(t, group, learner))
        record = p.Snapshot(t, learner, 8, sha(f"{t}/{learner}"), 0, (0, 0))
        self.put(p.group_snapshot_key(t, group, learner), p.encode(record))

    def group(self, t: int, group: str, members: list[str]) -> None:
        for learner in members:
            if p.group_snapshot_key(t, group, learner) not in self.published:
                self.snapshot(t, group, learner)
        commit = p.Commit(
            round=t,
            fragment=0,
            base=None,
            contributors=tuple(
                p.Contribution(m, 8, sha(f"{t}/{m}"), (0, 0)) for m in sorted(members)
            ),
            params=sha(f"{t}/{group}"),
            momentum=None,
            closer=members[0],
            group=group,
        )
        self.put(p.group_round_key(t, group), p.encode(commit))

    def gets(self) -> int:
        return self.counters.requests.get("get:group-rounds", 0)


def sha(text: str) -> str:
    return p.blob_key(hashlib.sha256(text.encode()).hexdigest())


def test_the_view_of_groups_of_different_sizes_and_learners_apart() -> None:
    run = GroupRun()
    learners = [f"l{i}" for i in range(7)]
    for slot, learner in enumerate(learners):
        run.slot(slot, learner)
        run.beat(learner, 1, samples=8 * (slot + 1))
    run.group(1, "x-000", ["l0", "l1", "l2", "l3"])
    run.group(1, "x-001", ["l4", "l5", "l6"])
    run.group(2, "000-x", ["l0", "l4"])
    run.group(2, "001-x", ["l1", "l5"])
    run.group(2, "002-x", ["l2", "l6"])
    run.snapshot(2, "003-x", "l3")  # its group is still open: l3 waits alone
    watcher = RunWatcher(run.box, lease_timeout=60)
    view = asyncio.run(watcher.poll())
    groups = view.groups
    assert groups is not None
    assert (groups.group_size, groups.grid_dims, groups.slots) == (4, 2, 7)
    assert view.rounds_committed == view.newest_round == groups.newest_round == 2
    assert [(r.round, r.sizes, r.learners, r.samples) for r in groups.rounds] == [
        (1, (3, 4), 7, 56),
        (2, (2, 2, 2), 6, 48),
    ]
    assert groups.open_groups == {2: ("003-x",)}
    assert view.last_contributors == ("l0", "l1", "l2", "l4", "l5", "l6")
    assert view.live_learners == 7
    assert groups.spread == 0  # every learner published to round 2
    assert view.samples_committed == sum(8 * (i + 1) for i in range(7))  # from the beats
    assert groups.describe() == "round 2, 3 groups of 2, versions spread 0"
    assert run.gets() == 5  # each group commit read once

    # Round 3: l0 and l1 meet; l2, l4, l5, l6 are still in round 2, l3 closes its group
    # alone. A later poll reads only the new records.
    run.group(2, "003-x", ["l3"])
    run.group(3, "x-000", ["l0", "l1"])
    run.snapshot(3, "x-001", "l4")
    view = asyncio.run(watcher.poll())
    groups = view.groups
    assert groups is not None
    assert run.gets() == 7
    assert groups.newest_round == 3
    assert [(r.round, r.sizes) for r in groups.rounds] == [
        (1, (3, 4)),
        (2, (1, 2, 2, 2)),
        (3, (2,)),
    ]
    newest = groups.newest
    assert newest is not None
    assert (newest.min_size, newest.median_size, newest.max_size) == (2, 2.0, 2)
    assert groups.rounds[1].median_size == 2.0
    assert groups.open_groups == {3: ("x-001",)}
    assert dict(groups.versions) == {"l0": 3, "l1": 3, "l2": 2, "l3": 2, "l4": 3, "l5": 2, "l6": 2}
    assert groups.spread == 1
    assert groups.describe() == "round 3, 1 group of 2, versions spread 1"
    # Nothing new: no record read again.
    asyncio.run(watcher.poll())
    assert run.gets() == 7
    # A fresh watcher sees the same.
    fresh = asyncio.run(inspect_run(run.box, lease_timeout=60)).groups
    assert fresh is not None
    assert (fresh.rounds, fresh.spread, fresh.open_groups) == (
        groups.rounds,
        groups.spread,
        groups.open_groups,
    )
    # A DiLoCo run has no groups.
    diloco = Run(gm.MemoryMailbox())
    diloco.create()
    assert asyncio.run(inspect_run(diloco.box)).groups is None


def test_the_operator_status_of_a_moshpit_run(run: MoshpitRun) -> None:
    from gradientmail_operator.observer import Observer
    from gradientmail_operator.status import view_status

    view = asyncio.run(inspect_run(run.box))
    newest = max(group_rounds(run.box))
    status = view_status(view)
    assert status["roundsCommitted"] == status["newestRound"] == newest
    assert status["groups"] == {
        "newestGroupRound": newest,
        "groups": 2,
        "groupSizeMin": 2,
        "groupSizeMedian": 2.0,
        "groupSizeMax": 2,
        "learnersInGroups": LEARNERS,
        "versionSpread": None,
        "openGroups": 0,
        "gridSlots": LEARNERS,
        "grid": "2×2",
        "summary": f"round {newest}, 2 groups of 2, versions spread —",
    }
    assert [learner["groupRound"] for learner in status["learners"]] == [newest] * LEARNERS
    seen = Observer()._fold(view)
    assert seen.progressing is not None
    training, _, message = seen.progressing
    assert training
    assert message == f"groups: round {newest}, 2 groups of 2, versions spread —, 0 learners live"


def test_inspect_stays_free_of_torch() -> None:
    """The operator's image has no torch: the view of a run (Moshpit's too) never imports it."""
    code = "import sys, gradientmail.inspect; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_run_report_says_what_the_curves_of_a_moshpit_run_show(run: MoshpitRun) -> None:
    """``gradientmail run``'s notes under the loss curves follow the manifest's algorithm:
    a Moshpit run has no commit of every fragment, its groups average among themselves."""
    assert run_algorithm(run.box) == "moshpit"
    aligned, own = curve_notes(run_algorithm(run.box))
    assert aligned == (
        "the average of the newest group round's commits, what `gradientmail align` loads"
    )
    assert own == "its own model: its shard between syncs, its group's average at each sync"
    box = gm.MemoryMailbox()
    assert run_algorithm(box) is None  # no manifest yet: the notes of a DiLoCo run
    Run(box).manifest()
    assert run_algorithm(box) == "diloco"
    for algorithm in ("diloco", None):
        aligned, own = curve_notes(algorithm)
        assert aligned == "the newest commit of every fragment, what `gradientmail align` loads"
        assert own == "its own model: its shard between syncs, each fragment's commit at its syncs"


def test_align_says_when_the_grid_has_averaged_everyone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a full grid without training, the groups of round D all commit the global
    average: align loads it as it is, and says so."""
    run = train_moshpit(tmp_path / "box", steps=D, learn=False)
    commits = [read_commit(run.box, p.group_round_key(D, g)) for g in group_rounds(run.box)[D]]
    assert len({c.params for c in commits}) == 1  # one payload: the same parameters
    target = tmp_path / "model.safetensors"
    status, stdout, stderr = gm_cli(capsys, "align", run.url, "--out", target)
    assert status == 0, stdout + stderr
    assert f"group round {D}'s commit, which all its 2 groups (4 learners) share" in stdout
    from safetensors.torch import load_file

    mean = sum(range(LEARNERS)) / LEARNERS
    for name, tensor in load_file(str(target)).items():
        assert torch.equal(tensor, torch.full_like(tensor, mean)), name


def test_a_moshpit_run_before_its_first_group_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    box = gm.FileMailbox(tmp_path / "box")
    model = _model(0)
    algorithm = gm.Moshpit(sync_every=10, group_size=M, grid_dims=D)
    gm.Session(model, algorithm=algorithm, mailbox=box, learner_id="alone").close()
    view = asyncio.run(inspect_run(box))
    assert view.groups is not None
    assert view.groups.newest_round is None
    assert view.groups.slots == 1
    assert view.rounds_committed == 0
    assert view.newest_round is None
    assert view.groups.describe() == "no group round committed yet"
    status, stdout, stderr = gm_cli(capsys, "status", box.url, "--json")
    assert status == 0, stderr
    assert json.loads(stdout)["groups"]["rounds"] == []
    target = tmp_path / "model.safetensors"
    status, stdout, stderr = gm_cli(capsys, "align", box.url, "--out", target)
    assert status == 0, stdout + stderr
    assert "the initial commit (no group round has committed yet)" in stdout
    from safetensors.torch import load_file

    written = load_file(str(target))
    for name, param in model.named_parameters():
        assert torch.equal(written[name], param.detach()), name
    status, stdout, stderr = gm_cli(capsys, "verify", box.url)
    assert status == 0, stdout + stderr
    assert group_counts(stdout) == (0, 0, 0, 0)
