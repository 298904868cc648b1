"""S3Mailbox: any S3-compatible store (AWS S3, R2, MinIO, SeaweedFS, ...) through boto3.

Create-once writes are ``PutObject`` with ``If-None-Match: *``: the store answers 412 when
the key exists, and 409 ``ConditionalRequestConflict`` when another conditional write to
the same key is in flight (retried three times, then :class:`MailboxUnavailable`).

Every request is bounded by botocore's own connect/read timeouts and a bounded number of
retries; no ``asyncio.timeout`` wraps a call, because cancelling ``asyncio.to_thread`` would
leave the request running in its thread. Timeouts, 5xx answers, throttling and connection
errors become :class:`MailboxUnavailable`; a missing bucket, bad credentials or a denied
access become :class:`MailboxConfigError` naming the bucket and endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import boto3
import botocore.exceptions as bce
from botocore.config import Config

from gradientmail.errors import MailboxConfigError, MailboxError, MailboxUnavailable
from gradientmail.mailbox._keys import check_key
from gradientmail.mailbox._threaded import ThreadedMailbox

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3Mailbox"]

DELETE_BATCH = 1000  # S3's DeleteObjects limit; SeaweedFS rejects larger batches
CONFLICT_RETRIES = 3  # 409 ConditionalRequestConflict retries before MailboxUnavailable

_CONFIG_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
        "InvalidBucketName",
        "PermanentRedirect",
        "AccountProblem",
        "NotSignedUp",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
    }
)


class S3Mailbox(ThreadedMailbox):
    """A mailbox in ``bucket`` under ``prefix`` (each run should use its own prefix).

    Credentials come from boto3's standard chain (environment, shared config and
    credentials files, container and instance metadata) unless given explicitly. Pass
    ``endpoint_url`` for anything that is not AWS S3. ``connect_timeout`` and
    ``read_timeout`` (seconds) bound every request and ``max_attempts`` bounds botocore's
    own retries, so no call can hang.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        profile_name: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 3,
        max_pool_connections: int = 32,
    ) -> None:
        if not bucket or "/" in bucket:
            raise ValueError(f"S3 bucket name {bucket!r} is empty or contains '/'")
        prefix = prefix.strip("/")
        if prefix:
            check_key(prefix)
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        self.bucket = bucket
        self.prefix = prefix
        self._root = f"{prefix}/" if prefix else ""
        self._settings: dict[str, Any] = {
            "endpoint_url": endpoint_url,
            "region_name": region_name,
            "aws_access_key_id": aws_access_key_id,
            "aws_secret_access_key": aws_secret_access_key,
            "aws_session_token": aws_session_token,
            "profile_name": profile_name,
            "connect_timeout": connect_timeout,
            "read_timeout": read_timeout,
            "max_attempts": max_attempts,
            "max_pool_connections": max_pool_connections,
        }
        if endpoint_url is not None and region_name is None:
            region_name = "us-east-1"  # custom endpoints rarely care; botocore insists
        session = boto3.session.Session(
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            region_name=region_name,
            profile_name=profile_name,
        )
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            max_pool_connections=max_pool_connections,
            s3={"addressing_style": "path"} if endpoint_url else None,
            # No CRC32 per request unless an operation requires one: every payload is named
            # by its sha256 and verified by its reader, and every record is validated, so a
            # per-request checksum only costs CPU (16 MiB puts: 127 ms -> 100 ms on
            # SeaweedFS here). It also keeps S3-compatible stores that reject the newer
            # checksum headers working.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # A boto3 client is thread-safe (a Session is not), so one serves every thread.
        self._client: S3Client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.endpoint_url: str = self._client.meta.endpoint_url

    @property
    def url(self) -> str:
        """An ``s3://`` URL that :func:`open_mailbox` turns back into this mailbox."""
        query: dict[str, str] = {}
        if self._settings["endpoint_url"]:
            query["endpoint"] = self._settings["endpoint_url"]
        if self._settings["region_name"]:
            query["region"] = self._settings["region_name"]
        tail = f"?{urlencode(query)}" if query else ""
        return f"s3://{self.bucket}/{quote(self.prefix)}{tail}"

    def __repr__(self) -> str:
        # Never print credentials.
        return (
            f"S3Mailbox(bucket={self.bucket!r}, prefix={self.prefix!r}, "
            f"endpoint={self.endpoint_url!r})"
        )

    def __reduce__(self) -> Any:
        # The client does not pickle; a child process builds its own from the same settings.
        return (_reopen, (self.bucket, self.prefix, self._settings))

    @property
    def _where(self) -> str:
        return f"bucket {self.bucket!r} at {self.endpoint_url}"

    # -- blocking implementations ----------------------------------------------------------

    def _put_if_absent(self, key: str, data: bytes) -> bool:
        full = self._root + key
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                return True
            except bce.ClientError as exc:
                code, status = _code_status(exc)
                if status == 412 or code == "PreconditionFailed":
                    return False
                if status == 409 or code == "ConditionalRequestConflict":
                    if attempt < CONFLICT_RETRIES:
                        time.sleep(0.05 * 2**attempt)  # in a worker thread, bounded
                        continue
                    raise MailboxUnavailable(
                        f"put_if_absent({key!r}) in {self._where}: the store reported a "
                        f"conflicting concurrent write {CONFLICT_RETRIES + 1} times"
                    ) from exc
                raise self._translate(exc, f"put_if_absent({key!r})") from exc
            except bce.BotoCoreError as exc:
                raise self._translate(exc, f"put_if_absent({key!r})") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _get(self, key: str) -> bytes | None:
        try:
            response = self._client.get_object(Bucket=self.bucket, Key=self._root + key)
            body = response["Body"].read()
        except bce.ClientError as exc:
            code, status = _code_status(exc)
            if code in ("NoSuchKey", "404") or (status == 404 and code != "NoSuchBucket"):
                return None
            raise self._translate(exc, f"get({key!r})") from exc
        except bce.BotoCoreError as exc:
            raise self._translate(exc, f"get({key!r})") from exc
        expected = response.get("ContentLength")
        if expected is not None and expected != len(body):
            raise MailboxUnavailable(
                f"get({key!r}) in {self._where}: received {len(body)} of {expected} bytes"
            )
        return body

    def _list(self, prefix: str, after: str) -> Sequence[str]:
        full_prefix = self._root + prefix
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
        if after and self._root + after > full_prefix:
            kwargs["StartAfter"] = self._root + after
        cut = len(self._root)
        keys: list[str] = []
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(**kwargs):
                for item in page.get("Contents", ()):
                    key = item["Key"][cut:]
                    # Re-apply the cursor: some gateways ignore StartAfter.
                    if key > after and key.startswith(prefix):
                        keys.append(key)
        except (bce.ClientError, bce.BotoCoreError) as exc:
            raise self._translate(exc, f"list({prefix!r})") from exc
        keys.sort()  # str order is code point order, which is UTF-8 byte order
        return keys

    def _delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            try:
                response = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": self._root + k} for k in batch], "Quiet": True},
                )
            except (bce.ClientError, bce.BotoCoreError) as exc:
                raise self._translate(exc, f"delete({len(keys)} keys)") from exc
            errors = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                code = first.get("Code", "")
                message = (
                    f"delete() in {self._where}: {len(errors)} of {len(batch)} keys failed, "
                    f"first {first.get('Key')!r}: {code} {first.get('Message', '')}"
                )
                if code in _CONFIG_CODES:
                    raise MailboxConfigError(message)
                raise MailboxUnavailable(message)

    def _translate(self, exc: Exception, what: str) -> MailboxError:
        """Turn a botocore failure into the mailbox error that says whose fault it is."""
        where = f"{what} in {self._where}"
        if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError):
            return MailboxConfigError(
                f"{where}: no usable AWS credentials ({exc}); set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, a profile, or an instance/pod role"
            )
        if isinstance(exc, bce.NoRegionError):
            return MailboxConfigError(f"{where}: no AWS region configured; pass region=")
        if isinstance(exc, bce.ConnectionError | bce.HTTPClientError | bce.IncompleteReadError):
            return MailboxUnavailable(f"{where}: {exc}")
        if isinstance(exc, bce.ClientError):
            code, status = _code_status(exc)
            message = exc.response.get("Error", {}).get("Message", "")
            if code == "NoSuchBucket":
                return MailboxConfigError(f"{where}: the bucket does not exist")
            if code in _CONFIG_CODES or status in (401, 403):
                return MailboxConfigError(
                    f"{where}: access refused ({code or status}: {message}); check the "
                    "credentials and the bucket policy"
                )
            if code in _TRANSIENT_CODES or status in (408, 429) or status >= 500:
                return MailboxUnavailable(f"{where}: {code or status}: {message}")
            return MailboxError(f"{where}: {code or status}: {message}")
        return MailboxError(f"{where}: {exc}")


def _code_status(exc: bce.ClientError) -> tuple[str, int]:
    error = exc.response.get("Error", {})
    meta = exc.response.get("ResponseMetadata", {})
    return str(error.get("Code", "")), int(meta.get("HTTPStatusCode", 0) or 0)


def _reopen(bucket: str, prefix: str, settings: dict[str, Any]) -> S3Mailbox:
    return S3Mailbox(bucket, prefix, **settings)
