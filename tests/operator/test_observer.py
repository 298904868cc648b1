"""The operator's mailbox observer against a scripted S3 on loopback (real botocore):
credentials read only when the watcher is built, a rotated key picked up, a hanging store
held to the poll budget, and a run with status turned off never read."""

from __future__ import annotations

import asyncio

from gradientmail.launch.runspec import GradientMailRunSpec
from gradientmail_operator.kube import Credentials
from gradientmail_operator.observer import DISABLED, MailboxLoop, Observer
from gradientmail_operator.reconcile import Reason
from testbed.stub_s3 import Reply, Request, error_xml, stub_s3
from tests.support.waiting import wait_until

EMPTY_LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name>'
    b"<KeyCount>0</KeyCount><IsTruncated>false</IsTruncated></ListBucketResult>"
)
LOOP = MailboxLoop(workers=4)


def spec(endpoint: str, **mailbox: object) -> GradientMailRunSpec:
    return GradientMailRunSpec.model_validate(
        {
            "nodes": 1,
            "mailbox": {
                "endpoint": endpoint,
                "bucket": "b",
                "credentialsSecret": {"name": "keys"},
                **mailbox,
            },
        }
    )


def url(endpoint: str) -> str:
    return f"s3://b/gradientmail/team/exp?endpoint={endpoint}"


class Secret:
    """The run's Secret: its current key and resourceVersion; counts reads."""

    def __init__(self, key: str, version: str) -> None:
        self.key, self.version, self.reads = key, version, 0

    async def __call__(self) -> Credentials:
        self.reads += 1
        values = {"aws_access_key_id": self.key, "aws_secret_access_key": "not-logged"}
        return Credentials(values, self.version)


def by_key(good: str) -> object:
    def respond(request: Request) -> Reply:
        if f"Credential={good}/" in request.headers.get("Authorization", ""):
            if "list-type" not in request.query:  # a GET of an object: an empty run
                return Reply(404, error_xml("NoSuchKey"))
            return Reply(200, EMPTY_LISTING, {"Content-Type": "application/xml"})
        return Reply(403, error_xml("InvalidAccessKeyId"))

    return respond


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_secret_is_read_when_the_watcher_is_built_and_a_rotation_is_picked_up() -> None:
    with stub_s3(by_key("new")) as s3:  # type: ignore[arg-type]
        secret, clock = Secret("new", "1"), Clock()
        observer = Observer(budget=30, secret_check=60, loop=LOOP, clock=clock)
        s = spec(s3.endpoint_url)
        for _ in range(3):
            seen = asyncio.run(observer.observe(s, url(s3.endpoint_url), secret))
            assert seen.reachable is not None
            assert seen.reachable[0] is True, seen.reachable
        assert secret.reads == 1, "the Secret was read on every poll"
        clock.now = 61  # the rotation check: same resourceVersion, same watcher
        asyncio.run(observer.observe(s, url(s3.endpoint_url), secret))
        assert secret.reads == 2
        # The key is rotated on the store; the Secret still holds the old one for a while.
        s3.respond = by_key("newer")  # type: ignore[assignment]
        refused = asyncio.run(observer.observe(s, url(s3.endpoint_url), secret))
        assert refused.reachable is not None
        assert refused.reachable[1] == Reason.MAILBOX_MISCONFIGURED
        secret.key, secret.version = "newer", "2"  # the Secret is updated
        back = asyncio.run(observer.observe(s, url(s3.endpoint_url), secret))
        assert back.reachable is not None
        assert back.reachable[0] is True, back.reachable
        assert secret.reads == 3  # re-read at once after the refusal, not a minute later


def test_a_hanging_store_is_held_to_the_poll_budget() -> None:
    def hang(request: Request) -> Reply:
        return Reply(hang=True)

    with stub_s3(hang) as s3:
        observer = Observer(budget=0.3, loop=LOOP)
        s = spec(s3.endpoint_url)
        first = asyncio.run(observer.observe(s, url(s3.endpoint_url), Secret("k", "1")))
        assert first.reachable is not None
        assert first.reachable[1] == Reason.POLL_TIMED_OUT
        asked = wait_until(lambda: len(s3.requests), "the poll's first request")
        second = asyncio.run(observer.observe(s, url(s3.endpoint_url), Secret("k", "1")))
        assert second.reachable is not None
        assert second.reachable[1] == Reason.POLL_TIMED_OUT
        assert "has been running" in second.reachable[2]
        assert len(s3.requests) == asked, "a second poll was started beside the first"


def test_status_off_reads_neither_the_secret_nor_the_store() -> None:
    secret = Secret("k", "1")
    observer = Observer(loop=LOOP)
    s = spec("http://127.0.0.1:9", pollStatus=False)
    assert asyncio.run(observer.observe(s, url("http://127.0.0.1:9"), secret)) is DISABLED
    assert secret.reads == 0
