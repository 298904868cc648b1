"""Shared fixtures: ``mailbox`` runs every test that asks for it once per store.

``MAILBOXES`` is a tuple of named generators, each yielding a fresh, empty store; a new
backend is one generator plus one entry here. S3 entries come from
``GRADIENTMAIL_S3_ENDPOINT`` (see ``testbed/s3env.py``); under CI they are required.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gradientmail import FileMailbox, Mailbox, MemoryMailbox
from testbed.s3env import S3Target, ensure_bucket, fresh_s3_mailbox, s3_targets
from tests.support import schedule
from tests.thirdparty.spec_file_mailbox import FileMailbox as SpecFileMailbox

pytest_plugins = ["testbed.kube.fixtures"]  # kube_cluster, kube_apiserver (the Kubernetes stand-in)


def memory() -> Iterator[Mailbox]:
    yield MemoryMailbox(f"test-{uuid.uuid4().hex[:8]}")


def filesystem() -> Iterator[Mailbox]:
    with tempfile.TemporaryDirectory() as root:
        yield FileMailbox(root)


def spec_filesystem() -> Iterator[Mailbox]:
    """The third-party example backend of spec 004, unchanged, against our suite."""
    with tempfile.TemporaryDirectory() as root:
        yield SpecFileMailbox(root)


def _s3(target: S3Target) -> Callable[[], Iterator[Mailbox]]:
    def generator() -> Iterator[Mailbox]:
        yield from fresh_s3_mailbox(target)

    return generator


S3_TARGETS = s3_targets()

if os.environ.get("CI") and not S3_TARGETS:
    raise pytest.UsageError(
        "CI is set but GRADIENTMAIL_S3_ENDPOINT is empty: run the suite through "
        "`python -m testbed.s3servers -- pytest` (what scripts/test.sh does)"
    )

MAILBOXES: tuple[tuple[str, Callable[[], Iterator[Mailbox]]], ...] = (
    ("memory", memory),
    ("filesystem", filesystem),
    ("spec-filesystem", spec_filesystem),
    *((f"s3-{t.name}", _s3(t)) for t in S3_TARGETS),
)


@pytest.fixture(scope="session")
def s3_buckets() -> list[S3Target]:
    for target in S3_TARGETS:
        ensure_bucket(target)
    return S3_TARGETS


@pytest.fixture(params=[name for name, _ in MAILBOXES])
def mailbox(request: pytest.FixtureRequest, s3_buckets: list[S3Target]) -> Iterator[Mailbox]:
    generator = dict(MAILBOXES)[request.param]
    yield from generator()


@pytest.fixture(
    params=[t.name for t in S3_TARGETS]
    or [
        pytest.param(
            "none", marks=pytest.mark.skipif(True, reason="GRADIENTMAIL_S3_ENDPOINT not set")
        )
    ]
)
def s3_target(request: pytest.FixtureRequest, s3_buckets: list[S3Target]) -> S3Target:
    return next(t for t in s3_buckets if t.name == request.param)


# -- requires_cuda: run where a GPU exists, reported as NOT RUN elsewhere -------------------

_NO_CUDA = "requires_cuda: no CUDA device on this machine, so this test was NOT RUN"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "requires_cuda: needs a CUDA device; where none exists the test is skipped with the "
        "reason 'requires_cuda: ... NOT RUN' and counted in the summary (never silently)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    schedule.arrange(config, items)  # in an xdist worker: the longest tests first
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("requires_cuda") is not None:
            item.add_marker(pytest.mark.skip(reason=_NO_CUDA))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when it is installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return schedule.make_scheduler(config, log)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line saying how many GPU tests did not run (also into GitHub's job summary)."""
    not_run = [
        report.nodeid
        for report in terminalreporter.stats.get("skipped", [])
        if _NO_CUDA in str(getattr(report, "longrepr", ""))
    ]
    if not not_run:
        return
    line = f"{len(not_run)} test(s) marked requires_cuda NOT RUN (no CUDA device here)"
    terminalreporter.write_sep("=", line, yellow=True)
    for nodeid in not_run:
        terminalreporter.write_line(f"NOT RUN (requires_cuda): {nodeid}")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as out:
            out.write(f"**{line}:**\n\n" + "".join(f"- `{n}`\n" for n in not_run) + "\n")
