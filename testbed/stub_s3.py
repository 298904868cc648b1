"""A scripted HTTP server on loopback that answers like a misbehaving S3, for fault injection.

Real botocore talks to it over real sockets, so the tests exercise S3Mailbox's actual error
handling: each test installs a ``respond(request) -> Reply`` function and inspects
``requests`` afterwards. Not a store: the contract runs against SeaweedFS and moto.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # accept the request and never answer
    short_by: int = 0  # announce more bytes than are sent, then close


def error_xml(code: str, message: str = "stub") -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>stub</RequestId></Error>"
    ).encode()


@dataclass
class StubS3:
    endpoint_url: str
    requests: list[Request]
    respond: Callable[[Request], Reply]


@contextmanager
def stub_s3(respond: Callable[[Request], Reply]) -> Iterator[StubS3]:
    release = threading.Event()
    state = StubS3("", [], respond)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            parts = urlsplit(self.path)
            request = Request(
                self.command,
                parts.path,
                parse_qs(parts.query, keep_blank_values=True),
                dict(self.headers.items()),
                body,
            )
            state.requests.append(request)
            reply = state.respond(request)
            if reply.hang:
                release.wait(30)
                self.close_connection = True
                return
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body) + reply.short_by))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)
            if reply.short_by:
                self.close_connection = True

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    host, port = server.server_address[:2]
    state.endpoint_url = f"http://{host}:{port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield state
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def closed_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
