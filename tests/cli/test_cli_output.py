"""What the ``gradientmail`` command prints: the table and ``status --json`` agree field by
field, failures are one line (a traceback only with ``--debug``), a hanging store fails
within the CLI's bounded wait, ``--help`` is plain text, URLs are shown decoded, and a
node's traceback folds into one line."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import gradientmail as gm
from gradientmail import wire as p
from gradientmail.cli import _HANDLERS, _parser, main
from gradientmail.cli._common import (
    DEFAULT_STORE_TIMEOUT,
    STORE_TIMEOUT_ENV,
    TracebackFolder,
    readable_url,
    s3_options,
    set_store_timeout,
)
from gradientmail.cli.table import NodeRow, render_run, view_json
from gradientmail.inspect import RunView, RunWatcher
from gradientmail.mailbox.url import open_mailbox
from testbed.stub_s3 import Reply, closed_port, stub_s3
from tests.cli.test_cli import cli
from tests.inspect.test_inspect import Run

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}


def text_of(renderable: Any, width: int = 160) -> str:
    with open(os.devnull, "w") as sink:
        console = Console(width=width, record=True, file=sink)
        console.print(renderable)
    return console.export_text()


# -- the table and the JSON agree ------------------------------------------------------------


def watched_run() -> tuple[RunView, list[RunView]]:
    """A run watched from t=100 to t=120 on a fake clock; returns the first poll's view and
    the views of the later polls."""
    now = [100.0]
    run = Run(gm.MemoryMailbox(), totals=True)
    run.create()
    run.commit(2, {"alice": 16, "bob": 16})
    run.commit(3, {"alice": 8})
    run.beat("alice", 1, steps=10, samples=80, sync_points=1, contributed=1, waited_s=0.5)
    # bob left before the watcher started; carol's beat is already old (she will lapse).
    run.beat("bob", p.LEAVING_BEAT, steps=80, samples=640, sync_points=16, contributed=4)
    run.beat("carol", 1, steps=7, samples=56, sync_points=1, contributed=1, skipped=1)
    watcher = RunWatcher(run.box, clock=lambda: now[0])
    first = asyncio.run(watcher.poll())
    now[0] = 110.0
    run.beat("alice", 2, steps=40, samples=320, sync_points=4, contributed=4, waited_s=2.5)
    run.beat("dave", 1, steps=0, samples=0)  # joins while watched
    run.commit(4, {"alice": 8})
    run.snapshot(5, "alice")
    second = asyncio.run(watcher.poll())
    now[0] = 120.0
    third = asyncio.run(watcher.poll())
    return first, [second, third]


def _summary(table: str) -> dict[str, str]:
    """The run's numbers in the table, by label."""
    labels = [
        "rounds committed",
        "newest round",
        "live learners",
        "samples/s",
        "commit lag",
        "open rounds",
        "fragments",
        "samples committed",
        "creator",
        "sync points reached",
        "contributed",
        "skipped",
        "waited",
    ]
    found = {}
    head = table.split("\n\n")[0]
    for label in labels:
        match = re.search(rf"(?:^|\s){re.escape(label)} (≥ [\d.,]+ s|[\d.,]+ s|\S+)", head, re.M)
        assert match is not None, (label, head)
        found[label] = match.group(1)
    return found


def _rows(table: str) -> dict[str, list[str]]:
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("learner"))
    return {
        cells[0]: cells
        for line in lines[header + 1 :]
        if line.strip()
        for cells in [re.split(r"\s{2,}", line.strip())]
    }


def _number(value: int | None) -> str:
    return "—" if value is None else f"{value:,}"


def _age(seconds: float | None, at_least: bool) -> str:
    return "—" if seconds is None else f"{'≥ ' if at_least else ''}{seconds:,.1f} s"


def check_agreement(view: RunView, polls: int, rate: float | None) -> dict[str, Any]:
    """Render the table and the JSON from one view; compare every field the table shows."""
    shown = view_json("memory://run", view, polls=polls, rate=rate)
    table = text_of(render_run("run", view, polls=polls, rate=rate))
    summary = _summary(table)
    sync = shown["sync"]
    rate_text = (
        "—" if shown["samples_per_second"] is None else f"{shown['samples_per_second']:,.0f}"
    )
    assert summary == {
        "rounds committed": str(shown["rounds_committed"]),
        "newest round": str(shown["newest_round"]),
        "live learners": str(shown["live_learners"]),
        "samples/s": rate_text,
        "commit lag": _age(shown["seconds_since_commit"], shown["commit_age_at_least"]),
        "open rounds": str(len(shown["open_rounds"])),
        "fragments": str(shown["fragments"]),
        "samples committed": f"{shown['samples_committed']:,}",
        "creator": shown["creator"],
        "sync points reached": f"{sync['sync_points']:,}",
        "contributed": f"{sync['contributed']:,}",
        "skipped": f"{sync['skipped']:,}",
        "waited": f"{sync['waited_s']:,.1f} s",
    }
    rows = _rows(table)
    assert sorted(rows) == sorted(v["learner"] for v in shown["learners"])
    for learner in shown["learners"]:
        waited = f"{learner['waited_s']:,.1f} s"
        if learner["waiting_fraction"] is not None:
            waited += f" ({learner['waiting_fraction']:.0%})"
        lease = learner["lease"]
        if learner["seconds_since_beat"] is not None:
            lease += f" ({_age(learner['seconds_since_beat'], learner['beat_age_at_least'])})"
        assert rows[learner["learner"]] == [
            learner["learner"],
            _number(learner["steps"]),
            _number(learner["samples"]),
            _number(learner["sync_points"]),
            _number(learner["contributed"]),
            _number(learner["skipped"]),
            waited,
            lease,
        ]
        assert lease.split()[0] in ("live", "lapsed", "left")
        assert (learner["beat"] is None) == learner["leaving"]  # no 9999999999
    return shown


def test_the_table_and_the_json_agree_field_by_field() -> None:
    first, later = watched_run()
    one = check_agreement(first, polls=1, rate=None)
    # One poll tells no age: none is shown, not 0.0 s for a run that may have ended long ago.
    assert one["seconds_since_commit"] is None
    assert one["samples_per_second"] is None
    assert [v["seconds_since_beat"] for v in one["learners"]] == [None, None, None]
    bob = next(v for v in one["learners"] if v["learner"] == "bob")
    assert (bob["lease"], bob["beat"], bob["leaving"]) == ("left", None, True)
    # Each trained sample once: (16 + 16 committed to fragment 0, 8 to fragment 1) / 2.
    assert one["samples_committed"] == 20

    for polls, view in enumerate(later, start=2):
        check_agreement(view, polls=polls, rate=2.5)
    final = check_agreement(later[-1], polls=3, rate=2.5)
    ages = {v["learner"]: (v["lease"], v["seconds_since_beat"], v["beat_age_at_least"])
            for v in final["learners"]}  # fmt: skip
    assert ages == {
        "alice": ("live", 10.0, False),  # its beat changed at t=110, seen changing
        "bob": ("left", 20.0, True),  # left before t=100: at least 20 s ago, not "3 s"
        "carol": ("lapsed", 20.0, True),
        "dave": ("live", 10.0, False),  # arrived while watched
    }
    # Commit 4 appeared at t=110, under watch: its age is known.
    assert (final["seconds_since_commit"], final["commit_age_at_least"]) == (10.0, False)
    assert final["samples_committed"] == 24  # round 4 added 8 to fragment 0
    assert final["samples_per_second"] == 2.5
    assert final["open_rounds"] == {"5": ["alice"]}


def test_a_finished_run_watched_later_shows_lower_bounds() -> None:
    """Everything was there at the first poll: the lag and the beats' ages are at least the
    watching time, and the table says so with ≥."""
    now = [50.0]
    run = Run(gm.MemoryMailbox(), totals=True)
    run.create()
    run.commit(2, {"alice": 4})
    run.beat("alice", p.LEAVING_BEAT, steps=4, samples=4)
    watcher = RunWatcher(run.box, clock=lambda: now[0])
    asyncio.run(watcher.poll())
    now[0] = 53.0
    view = asyncio.run(watcher.poll())
    shown = check_agreement(view, polls=2, rate=None)
    assert (shown["seconds_since_commit"], shown["commit_age_at_least"]) == (3.0, True)
    table = text_of(render_run("run", view, polls=2))
    assert "commit lag ≥ 3.0 s" in table
    assert "left (≥ 3.0 s)" in table


def test_the_run_table_rows_make_sense() -> None:
    """Under ``run``: one pair of parentheses in a failed node's state, steps past the
    target after a rejoin explained, and no samples 0 from a beat older than the first
    step of a node that is training."""
    run = Run(gm.MemoryMailbox())
    run.create()
    run.beat("a", 1, steps=0, samples=0)  # the join beat, before the start barrier
    run.beat("b", 3, steps=674, samples=5392)
    run.beat("c", 2, steps=10, samples=80)
    view = asyncio.run(RunWatcher(run.box).poll())
    nodes = [
        NodeRow("a", "training", 150, 200, 1.0, 0.5, 0),
        NodeRow("b", "training", 40, 200, 1.0, 0.5, 1),
        NodeRow("c", "failed (exit 1)", 10, 200, 1.0, 0.9, 1),
    ]
    table = text_of(render_run("run", view, polls=1, nodes=nodes), width=200)
    rows = {line.split()[0]: line for line in table.splitlines() if line[:2] in ("a ", "b ", "c ")}
    assert re.search(r"^a\s+training\s+\S+\s+150/200\s+.*?\s—\s", rows["a"]), rows["a"]
    assert "674 (200 per start)" in rows["b"]
    assert "674/200" not in table
    assert "training (restarts 1)" in rows["b"]
    assert "5,392" in rows["b"]
    assert "failed (exit 1, restarts 1)" in rows["c"]
    assert ") (" not in table


# -- --help, URLs ----------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_help_is_plain_text() -> None:
    parser = _parser()
    commands = _subparsers(parser)
    assert {"run", "status", "align", "verify", "sweep", "rm", "demo"} <= set(commands)
    for name, command in [("gradientmail", parser), *commands.items()]:
        text = command.format_help()
        assert "``" not in text, (name, text)
        assert "%3A" not in text, name
        assert "%2F" not in text, name
    verify = " ".join(commands["verify"].format_help().split())
    assert "newest keep_rounds - 1 commits stay verifiable" in verify


def test_help_through_the_entry_point() -> None:
    for command in ("status", "sweep", "demo", "verify"):
        done = cli(command, "--help")
        assert done.returncode == 0, done.stderr
        assert "``" not in done.stdout
        assert "--store-timeout" in done.stdout


def test_a_command_imports_only_what_it_needs(tmp_path: Path) -> None:
    """``status``, ``sweep`` and ``rm`` start without torch, and without the spec models of
    ``run`` (pydantic, yaml): a command imports its own module only."""
    code = (
        "import sys\n"
        "from gradientmail.cli import main\n"
        "for words in (['status', sys.argv[1]], ['sweep', sys.argv[1]], ['rm', sys.argv[1]]):\n"
        "    assert main(words) == 1\n"
        "heavy = ('torch', 'pydantic', 'yaml', 'gradientmail.cli.run', 'gradientmail.cli.tools')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    box = tmp_path / "box"
    box.mkdir()
    (box / "notes.txt").write_text("not a mailbox")
    done = subprocess.run(
        [sys.executable, "-c", code, box.as_uri()], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
    assert done.stderr.count("is not a GradientMail mailbox directory") == 3, done.stderr


def test_urls_are_shown_decoded() -> None:
    encoded = "s3://bucket/run?endpoint=http%3A%2F%2F127.0.0.1%3A9000&region=eu%2Dwest"
    readable = readable_url(encoded)
    assert readable == "s3://bucket/run?endpoint=http://127.0.0.1:9000&region=eu-west"
    box_a, box_b = open_mailbox(encoded), open_mailbox(readable)
    assert isinstance(box_a, gm.S3Mailbox)
    assert isinstance(box_b, gm.S3Mailbox)
    assert box_a.url == box_b.url  # the same mailbox
    # What would change the meaning stays escaped.
    tricky = "s3://b/r?endpoint=http%3A%2F%2Fh%3A1%2Fa%26b%3Dc%2Bd%25"
    assert readable_url(tricky) == "s3://b/r?endpoint=http://h:1/a%26b%3Dc%2Bd%25"
    assert repr(open_mailbox(readable_url(tricky))) == repr(open_mailbox(tricky))
    settings = [open_mailbox(u).__reduce__()[1] for u in (tricky, readable_url(tricky))]
    assert settings[0] == settings[1]
    assert readable_url("file:///tmp/x") == "file:///tmp/x"

    url = f"s3://bucket/run?endpoint=http%3A%2F%2F127.0.0.1%3A{closed_port()}"
    done = cli("status", url, "--store-timeout", "2", **CREDENTIALS)
    assert done.returncode == 1
    assert f"cannot reach the mailbox at {readable_url(url)}" in done.stderr
    assert "%3A" not in done.stderr


# -- bounded waits ---------------------------------------------------------------------------


def test_store_timeout_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STORE_TIMEOUT_ENV, raising=False)
    set_store_timeout(None)
    assert s3_options()["read_timeout"] == DEFAULT_STORE_TIMEOUT
    monkeypatch.setenv(STORE_TIMEOUT_ENV, "4")
    assert s3_options() == {"connect_timeout": 4.0, "read_timeout": 4.0, "max_attempts": 2}
    set_store_timeout(1.5)
    try:
        assert s3_options()["connect_timeout"] == 1.5  # the flag wins
    finally:
        set_store_timeout(None)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_hanging_store_fails_in_one_line(how: str) -> None:
    """The store accepts each request and never answers: the command gives up after its
    bounded wait (two tries of 1 s here) with one line naming the endpoint."""
    with stub_s3(lambda request: Reply(hang=True)) as s3:
        url = f"s3://bucket/run?endpoint={s3.endpoint_url}"
        flags = ["--store-timeout", "1"] if how == "flag" else []
        env = CREDENTIALS | ({STORE_TIMEOUT_ENV: "1"} if how == "environment" else {})
        done = cli("status", url, *flags, timeout=60, **env)
        assert s3.requests, "the store was asked"
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"gradientmail status: cannot reach the mailbox at {url}")
    assert s3.endpoint_url in lines[0]
    assert "timeout" in lines[0].lower()


def test_a_bad_store_timeout_is_a_usage_error() -> None:
    done = cli("status", "file:///nonexistent", **{STORE_TIMEOUT_ENV: "soon"})
    assert done.returncode == 2
    assert f"{STORE_TIMEOUT_ENV}='soon' is not a positive number of seconds" in done.stderr
    done = cli("status", "file:///nonexistent", "--store-timeout", "0")
    assert done.returncode == 2
    assert "--store-timeout must be a positive number" in done.stderr


# -- one line per failure --------------------------------------------------------------------


def one_line(done: Any) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return str(lines[0])


def test_align_to_an_unwritable_path(tmp_path: Path) -> None:
    box = gm.FileMailbox(tmp_path / "box")
    Run(box).create()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = cli("align", box.url, "-o", blocker / "sub" / "model.safetensors")
    assert done.returncode == 2
    assert f"{blocker} is a file, not a folder" in one_line(done)
    folder = tmp_path / "folder"
    folder.mkdir()
    done = cli("align", box.url, "-o", folder)
    assert done.returncode == 2
    assert "is a directory" in one_line(done)


def test_a_bad_bucket_name_is_said_in_words() -> None:
    done = cli("status", "s3://bad!bucket/run?endpoint=http://127.0.0.1:1", **CREDENTIALS)
    assert done.returncode == 2
    line = one_line(done)
    assert "'bad!bucket' is not a bucket name: use letters, digits" in line
    assert "regex" not in line


def test_unexpected_errors_are_one_line_unless_debug(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise RuntimeError("something\nbroke")

    def denied(args: argparse.Namespace) -> int:
        raise PermissionError(13, "Permission denied", "/srv/model.safetensors")

    monkeypatch.setitem(_HANDLERS, "status", broken)
    assert main(["status", "file:///x"]) == 1
    line = capsys.readouterr().err.strip()
    assert line == (
        "gradientmail status: unexpected RuntimeError: something broke "
        "(--debug shows the traceback; please report it)"
    )
    with pytest.raises(RuntimeError):
        main(["status", "file:///x", "--debug"])
    monkeypatch.setitem(_HANDLERS, "status", denied)
    assert main(["status", "file:///x"]) == 1
    assert capsys.readouterr().err.strip() == (
        "gradientmail status: /srv/model.safetensors: Permission denied"
    )
    assert main(["status", "file:///x", "--debug"]) == 1
    captured = capsys.readouterr().err
    assert "Traceback (most recent call last)" in captured
    assert captured.strip().endswith("/srv/model.safetensors: Permission denied")


# -- a node's traceback ----------------------------------------------------------------------


def _chained_traceback() -> list[str]:
    try:
        try:
            raise TimeoutError("no creator in 120 s")
        except TimeoutError as exc:
            raise gm.ProtocolError("join failed: the run's creator never wrote a manifest") from exc
    except gm.ProtocolError:
        return traceback.format_exc().splitlines()


def test_a_node_traceback_folds_into_one_line() -> None:
    folder = TracebackFolder("node-0: ", " (the traceback is in logs/node-0.log)")
    lines = ["node-0: joined", *_chained_traceback(), "after", *_chained_traceback()]
    shown = [out for line in lines for out in folder.feed(line)] + folder.flush()
    final = (
        "node-0: gradientmail.errors.ProtocolError: join failed: the run's creator never "
        "wrote a manifest (the traceback is in logs/node-0.log)"
    )
    assert shown == ["node-0: joined", final, "after", final]
    cut = TracebackFolder()
    assert [*cut.feed("Traceback (most recent call last):"), *cut.feed('  File "x"')] == []
    assert cut.flush() == ["a traceback without its last line"]


def test_debug_is_an_option_of_every_subcommand() -> None:
    for name, command in _subparsers(_parser()).items():
        options = command._option_string_actions
        assert "--debug" in options, name
        assert "--store-timeout" in options, name
