"""The trainer's HTTP server against hostile clients, over raw sockets (workload/process/serving.py): bodies that
headers misdescribe, clients that say nothing or trickle, header floods, more connections than allowed.
Nothing is asserted about how long anything took: each check waits (with a generous bound) for what the
server must do, and the old server never does it."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import pytest

from tpu_workload.process import serving


class Endpoint:
    def __init__(self, **options):
        self.bodies: list[bytes] = []

        def accept(path: str, body: bytes, headers: dict[str, str]):
            self.bodies.append(body)
            return 200, b'{"ok": true}', "application/json"

        self.server = serving.serve_http(
            lambda path: (200, b"{}", "application/json"), 0, "127.0.0.1", accept, **options
        )
        self.port = self.server.server_address[1]

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        return sock

    def exchange(self, request: bytes) -> bytes:
        with self.connect() as sock:
            sock.sendall(request)
            return read_all(sock)


def read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def endpoints() -> Iterator[list[Endpoint]]:
    made: list[Endpoint] = []
    yield made
    for endpoint in made:
        endpoint.server.shutdown()
        endpoint.server.server_close()


@pytest.fixture
def endpoint(endpoints) -> Endpoint:
    endpoints.append(Endpoint())
    return endpoints[-1]


def post(headers: str, body: bytes = b"") -> bytes:
    return f"POST /profile HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode() + body


@pytest.mark.parametrize(
    "headers, status",
    [
        ("Content-Length: -1\r\n", b"400"),  # read as "to the end": 200 MiB were taken this way
        ("Content-Length: abc\r\n", b"400"),
        ("Content-Length: +5\r\n", b"400"),
        ("Content-Length: 0x10\r\n", b"400"),
        ("Content-Length: 5\r\nContent-Length: 6\r\n", b"400"),
        ("", b"411"),
        ("Transfer-Encoding: chunked\r\n", b"411"),
        ("Content-Length: 209715200\r\n", b"413"),
        (f"Content-Length: {serving.MAX_BODY_BYTES + 1}\r\n", b"413"),
    ],
)
def test_a_body_its_headers_misdescribe_is_refused_unread(endpoint, headers, status):
    # The body is never sent: the answer must come from the headers alone, and the handler never runs.
    answer = endpoint.exchange(post(headers))
    assert answer.split(b" ")[1] == status, answer
    assert endpoint.bodies == []


def test_a_body_within_the_limit_reaches_the_handler(endpoint):
    body = b'{"steps": "1-2"}'
    answer = endpoint.exchange(post(f"Content-Length: {len(body)}\r\n", body))
    assert answer.startswith(b"HTTP/1.0 200") and endpoint.bodies == [body]


def closed_by_server(sock: socket.socket, trickle: bool) -> bool:
    """Wait (30 s at most) for the server to close `sock`, sending a byte of a header every 0.1 s if `trickle`."""
    if trickle:
        sock.sendall(b"GET /status HTTP/1.0\r\nX-Slow: ")
    for _ in range(300):
        if trickle:
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                return True
        if select.select([sock], [], [], 0.1)[0]:
            try:
                return sock.recv(65536) == b""
            except ConnectionResetError:
                return True
    return False


@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickling"])
def test_a_client_that_does_not_finish_its_request_is_dropped(endpoints, trickle):
    endpoints.append(Endpoint(timeout_s=0.5))
    with endpoints[-1].connect() as sock:
        assert closed_by_server(sock, trickle)


def test_a_header_flood_is_cut_off(endpoint):
    flood = b"GET /status HTTP/1.0\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 1000) for i in range(60)) + b"\r\n"
    try:
        answer = endpoint.exchange(flood)
    except ConnectionResetError:
        answer = b""
    assert not answer.startswith(b"HTTP/1.0 200"), answer[:100]


def test_connections_over_the_cap_are_answered_503_and_slots_come_back(endpoints):
    endpoints.append(Endpoint(max_connections=2))
    endpoint = endpoints[-1]
    held = [endpoint.connect() for _ in range(2)]
    try:
        for sock in held:  # each has a thread once its first byte arrives
            sock.sendall(b"G")
        extra = endpoint.exchange(b"GET /status HTTP/1.0\r\n\r\n")
        assert extra.startswith(b"HTTP/1.0 503"), extra
    finally:
        for sock in held:
            sock.close()
    for _ in range(300):  # the two threads see their clients gone and give their slots back
        answer = endpoint.exchange(b"GET /status HTTP/1.0\r\n\r\n")
        if answer.startswith(b"HTTP/1.0 200"):
            break
        time.sleep(0.1)
    assert answer.startswith(b"HTTP/1.0 200"), answer
