"""A real S3-compatible server on loopback (moto's standalone server, its own process) and a
fault-injecting HTTP proxy in front of it, for tests and benchmarks."""

from __future__ import annotations

import http.client
import itertools
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers import free_port

TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "areal-test-key-id",
    "AWS_SECRET_ACCESS_KEY": "areal-test-secret-3c8d1f0b9a",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""Credentials for the test server; the secret is distinctive so tests can grep for leaks."""


class MotoServer:
    """``python -m moto.server`` on a free loopback port, until ``stop``."""

    def __init__(self, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start (see {log_path})") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


FAULT_REPLIES = {
    "503": (503, b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"),
    "500": (500, b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"),
}


class FaultProxy:
    """Forwards HTTP to ``upstream``; every ``every``-th request whose method is in ``methods`` (and
    whose path contains ``match``) gets the next fault of ``kinds`` ("503" SlowDown, "500"
    InternalError, "reset": the connection is reset without a reply, "stall": no reply for a minute,
    then a reset), until ``limit`` faults have been injected."""

    def __init__(
        self,
        upstream: str,
        kinds=("503", "500", "reset"),
        every: int = 3,
        limit: int = 0,
        methods=("PUT", "POST", "GET", "HEAD"),
        match: str = "",
    ):
        self.upstream = upstream.removeprefix("http://")
        self.every, self.limit, self.methods, self.match = every, limit, set(methods), match
        self._kinds = itertools.cycle(kinds)
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []
        self.injected: list[tuple[str, str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().split(b";")[0], 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _handle(self):
                body = self._body()
                fault = proxy._next_fault(self.command, self.path)
                if fault == "stall":
                    time.sleep(60)
                    fault = "reset"
                if fault == "reset":
                    # RST instead of FIN: the client sees "connection reset by peer".
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                if fault:
                    status, payload = FAULT_REPLIES[fault]
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                conn.request(
                    self.command,
                    self.path,
                    body=body if body or self.command in ("PUT", "POST") else None,
                    headers=headers,
                )
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(key, value)
                self.send_header(
                    "Content-Length",
                    str(len(data)) if self.command != "HEAD" else reply.getheader("Content-Length", "0"),
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _next_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            self.requests.append((method, path))
            if method not in self.methods or self.match not in path or len(self.injected) >= self.limit:
                return None
            matching = sum(1 for m, p in self.requests if m in self.methods and self.match in p)
            if matching % self.every:
                return None
            kind = next(self._kinds)
            self.injected.append((kind, method, path))
            return kind

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
