"""Which S3 servers the tests use: parsed from ``GRADIENTMAIL_S3_ENDPOINT``.

The variable holds one or more comma-separated entries ``[name=]http://host:port[/bucket]``;
the bucket defaults to ``GRADIENTMAIL_S3_BUCKET`` or ``gradientmail-test``. Credentials
come from the standard AWS environment (``AWS_ACCESS_KEY_ID`` ...). ``.ci/run`` starts
SeaweedFS and moto and sets it (see ``testbed/s3servers.py``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import boto3
from botocore.config import Config

from gradientmail import S3Mailbox


@dataclass(frozen=True)
class S3Target:
    name: str
    endpoint_url: str
    bucket: str

    def client(self):  # type: ignore[no-untyped-def]
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            config=Config(s3={"addressing_style": "path"}, retries={"total_max_attempts": 3}),
        )

    def mailbox(self, prefix: str | None = None) -> S3Mailbox:
        return S3Mailbox(
            self.bucket,
            prefix or f"test-{uuid.uuid4().hex[:12]}",
            endpoint_url=self.endpoint_url,
        )


def s3_targets() -> list[S3Target]:
    raw = os.environ.get("GRADIENTMAIL_S3_ENDPOINT", "").strip()
    default_bucket = os.environ.get("GRADIENTMAIL_S3_BUCKET", "gradientmail-test")
    targets = []
    for index, entry in enumerate(e.strip() for e in raw.split(",") if e.strip()):
        name, sep, url = entry.partition("=")
        if not sep or "://" in name:
            name, url = ("s3" if index == 0 else f"s3-{index}"), entry
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"GRADIENTMAIL_S3_ENDPOINT entry {entry!r} is not an http(s) URL")
        bucket = parts.path.strip("/") or default_bucket
        targets.append(S3Target(name, f"{parts.scheme}://{parts.netloc}", bucket))
    return targets


def ensure_bucket(target: S3Target) -> None:
    client = target.client()
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if target.bucket not in existing:
        try:
            client.create_bucket(Bucket=target.bucket)
        except client.exceptions.ClientError as exc:
            # Two pytest-xdist workers both saw no bucket and both create it: the second
            # one's "already yours" is the bucket this worker wanted.
            code = exc.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise


def remove_prefix(target: S3Target, prefix: str) -> None:
    client = target.client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=target.bucket, Prefix=prefix.rstrip("/") + "/"
    ):
        keys.extend(item["Key"] for item in page.get("Contents", ()))
    for start in range(0, len(keys), 1000):
        client.delete_objects(
            Bucket=target.bucket,
            Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]], "Quiet": True},
        )


def fresh_s3_mailbox(target: S3Target) -> Iterator[S3Mailbox]:
    box = target.mailbox()
    try:
        yield box
    finally:
        remove_prefix(target, box.prefix)
