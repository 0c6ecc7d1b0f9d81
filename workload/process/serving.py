"""Process 0's HTTP server (stdlib, threads), hardened for a port anyone on the network may reach.

With host networking the port listens on the node's address, and even without it any pod may connect:
every request is untrusted, and the server's cost per client must be small and bounded, whatever the
client sends or withholds:
- one request per connection (HTTP/1.0), and all of it (request line, headers, body) within
  `REQUEST_TIMEOUT_S` of the connection's accept: an idle or trickling client is dropped, it does not
  keep a thread for ever;
- at most `MAX_REQUEST_BYTES` read from a connection: a header flood is cut off like a big body;
- a POST body needs one plain decimal `Content-Length` of at most `MAX_BODY_BYTES`: missing (or
  chunked) is 411, malformed (`-1`, `+5`, `0x10`, two different values) is 400, larger is 413, each
  answered without reading the body;
- at most `MAX_CONNECTIONS` connections at once; one more is answered 503 and closed from the
  accepting thread, without a thread of its own.

Control requests (a POST: anything that changes the trainer) need the job's control token (controller/control.py)
in the header `X-Tpujob-Control-Token` (what passes the API server's pod proxy) or `Authorization: Bearer`; 401
otherwise. The pod holds only the token's SHA-256 (`TPUJOB_CONTROL_TOKEN_SHA256`, hex, from the operator); the
trainer compares the SHA-256 of the token presented with it, in constant time, after bounding its length
(`MAX_TOKEN_CHARS`). A pod of a JobSet made by an operator before the control key (one that made a Secret
`<job>-control` per job) names a file holding the token itself instead
(`TPUJOB_CONTROL_TOKEN_FILE`, its mounted Secret), still taken. Neither given (`tpujob render` without an
operator), or one unusable (a malformed digest, an unreadable file): every control request is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

Respond = Callable[[str], "tuple[int, bytes, str]"]  # path -> (HTTP status, body, content type)
# path, request body, request headers -> (HTTP status, body, content type)
Accept = Callable[[str, bytes, dict[str, str]], "tuple[int, bytes, str]"]

MAX_BODY_BYTES = 4096  # a POST here is a small JSON request (/profile)
MAX_REQUEST_BYTES = 16 * 1024  # request line, headers and body: a real one is well under 1 KiB
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16  # the operator reads one job's trainer once at a time; scrapers are a few more
_LENGTH = re.compile(r"\d{1,9}")
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


CONTROL_DIGEST = "TPUJOB_CONTROL_TOKEN_SHA256"
CONTROL_TOKEN_FILE = "TPUJOB_CONTROL_TOKEN_FILE"  # a JobSet made before the control key: the token in a file
CONTROL_HEADER = "x-tpujob-control-token"
MAX_TOKEN_CHARS = 256  # a token is 43 characters (base64url of 32 bytes); a longer header is refused unhashed
_DIGEST = re.compile(r"[0-9a-f]{64}")


def control_digest(environ=os.environ) -> str:
    """The SHA-256 (hex) of the job's control token: `TPUJOB_CONTROL_TOKEN_SHA256`, else that of the token in the
    file `TPUJOB_CONTROL_TOKEN_FILE` names; "" (nothing matches it) when neither is given, or the one given is
    unusable."""
    given = environ.get(CONTROL_DIGEST)
    if given is not None:
        if _DIGEST.fullmatch(given.strip().lower()):
            return given.strip().lower()
        log.error("control: %s is not a SHA-256 in hex: control requests are refused", CONTROL_DIGEST)
        return ""
    path = environ.get(CONTROL_TOKEN_FILE)
    if not path:
        log.warning("control: no control credential given (%s): control requests are refused", CONTROL_DIGEST)
        return ""
    try:
        with open(path) as f:
            token = f.read(MAX_TOKEN_CHARS + 1).strip()
    except OSError as exc:
        log.error("control: cannot read the control credential %s (%s): control requests are refused", path, exc)
        return ""
    return hashlib.sha256(token.encode()).hexdigest() if 0 < len(token) <= MAX_TOKEN_CHARS else ""


def authorized(headers: dict[str, str], digest: str | None) -> bool:
    """Whether a control request carries the token whose SHA-256 is `digest` (compared in constant time); None:
    none is needed (a server started without a credential, in tests)."""
    if digest is None:
        return True
    given = headers.get(CONTROL_HEADER) or headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not digest or not given or len(given) > MAX_TOKEN_CHARS:
        return False
    return hmac.compare_digest(hashlib.sha256(given.encode()).hexdigest(), digest)


class RequestTooLarge(ConnectionError):
    """The client sent more than MAX_REQUEST_BYTES: the connection is dropped without an answer."""


class _Bounded(io.RawIOBase):
    """The connection's input, each read given only the time left until the request's deadline and the
    bytes left of its budget (socket timeouts alone reset on every byte a trickling client sends)."""

    def __init__(self, sock: socket.socket, deadline: float, budget: int):
        super().__init__()
        self.sock, self.deadline, self.budget = sock, deadline, budget

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive in time")
        if self.budget <= 0:
            raise RequestTooLarge(f"the request is larger than {MAX_REQUEST_BYTES} bytes")
        self.sock.settimeout(left)
        n = self.sock.recv_into(memoryview(buffer)[: self.budget])
        self.budget -= n
        return n


def body_length(headers) -> tuple[int, str] | int:
    """The POST body's length from its headers, or (HTTP status, reason) to refuse it with."""
    if headers.get("Transfer-Encoding") is not None:
        return 411, "send the body with Content-Length, not Transfer-Encoding"
    values = {v.strip() for v in headers.get_all("Content-Length") or ()}
    if not values:
        return 411, "Content-Length is required"
    if len(values) > 1 or not _LENGTH.fullmatch(next(iter(values))):
        return 400, "Content-Length must be one decimal number of bytes"
    length = int(next(iter(values)))
    if length > MAX_BODY_BYTES:
        return 413, f"the body may be at most {MAX_BODY_BYTES} bytes"
    return length


class Server(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on connections (one thread each) and quiet about clients that vanish."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int = MAX_CONNECTIONS):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            try:  # a fresh socket's send buffer is empty: this never blocks the accepting thread
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        log.debug("http: connection from %s dropped", client_address, exc_info=True)


def serve_http(
    respond: Respond,
    port: int,
    host: str = "0.0.0.0",
    accept: Accept | None = None,
    *,
    timeout_s: float = REQUEST_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> Server:
    """Answer GET requests with `respond(path)`, and POST requests with `accept(path, body, headers)` where
    given, from a daemon thread (port 0 picks a free one)."""

    class Handler(BaseHTTPRequestHandler):
        def setup(self):
            super().setup()
            self.rfile = io.BufferedReader(_Bounded(self.connection, time.monotonic() + timeout_s, MAX_REQUEST_BYTES))

        def do_GET(self):  # noqa: N802
            self._send(*respond(self.path.split("?")[0]))

        def do_POST(self):  # noqa: N802
            if accept is None:
                return self._send(405, b"method not allowed\n", "text/plain")
            length = body_length(self.headers)
            if isinstance(length, tuple):
                return self._send(length[0], f"{length[1]}\n".encode(), "text/plain")
            body = self.rfile.read(length)
            if len(body) < length:
                return None  # the client closed before its body ended: nobody to answer
            headers = {k.lower(): v for k, v in self.headers.items()}
            self._send(*accept(self.path.split("?")[0], body, headers))

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.close_connection = True
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = Server((host, port), Handler, max_connections)
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server
