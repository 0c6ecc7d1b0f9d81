"""The metrics reader against trainers that misbehave, over real sockets: a real HTTP server (stdlib, a
thread) stands in for the trainer, and for the API server's pod proxy in front of it. Nothing under test
is mocked: the reader, AsyncKube and aiohttp do their real reads.

What is measured is what the stand-in managed to send before the reader hung up (a 200 MB answer must
stop at the socket buffers, not be read whole) and what the reader says; never how long anything took."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes_asyncio import client as k8s

from tests.fakes import FakeKube, add_pod0, manager_for
from tpu_operator.controller.kube import AsyncKube
from tpu_operator.controller.metrics_reader import MetricsReader

HUGE = 200 * 1024 * 1024  # what the hostile trainer offers
CHUNK = b"x" * 65536
POD = "job-slice-0-0-x"
SELECTOR_PODS = {
    "items": [
        {
            "metadata": {"name": POD, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "podIP": "127.0.0.1"},
        }
    ]
}


class Trainer:
    """A stand-in trainer (and pod proxy): `answer(handler)` writes the response; `sent` counts the body
    bytes it got onto the socket, `requests` the requests; `done` is set when a response ended."""

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler, Trainer], None]):
        self.sent, self.requests, self.done = 0, 0, threading.Event()
        trainer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if "/pods?" in self.path:  # the API server's pod list (the proxy case)
                    body = json.dumps(SELECTOR_PODS).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                trainer.requests += 1
                try:
                    answer(self, trainer)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the reader hung up: what it should do
                finally:
                    trainer.done.set()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def write(self, handler: BaseHTTPRequestHandler, data: bytes) -> None:
        handler.wfile.write(data)
        handler.wfile.flush()
        self.sent += len(data)


def huge(declared: bool) -> Callable[[BaseHTTPRequestHandler, Trainer], None]:
    """200 MB as fast as the socket takes it, its length declared or not (HTTP/1.0: until the connection closes)."""

    def answer(handler: BaseHTTPRequestHandler, trainer: Trainer) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        if declared:
            handler.send_header("Content-Length", str(HUGE))
        handler.end_headers()
        trainer.write(handler, b'{"step": 1, "pad": "')
        while trainer.sent < HUGE:
            trainer.write(handler, CHUNK)

    return answer


def trickle(handler: BaseHTTPRequestHandler, trainer: Trainer) -> None:
    """A valid small answer, one byte at a time, never finished within any deadline."""
    handler.send_response(200)
    handler.send_header("Content-Length", "100")
    handler.end_headers()
    for byte in b'{"step": 1' + b" " * 89 + b"}":
        trainer.write(handler, bytes([byte]))
        time.sleep(0.2)


def nested(handler: BaseHTTPRequestHandler, trainer: Trainer) -> None:
    """Under the size limit, but deeper than the JSON parser's recursion."""
    body = b"[" * 60000
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    trainer.write(handler, body)


@pytest.fixture
def trainers() -> Iterator[list[Trainer]]:
    made: list[Trainer] = []
    yield made
    for trainer in made:
        trainer.server.shutdown()
        trainer.server.server_close()


def read_direct(trainer: Trainer, timeout_s: float = 3.0):
    kube = FakeKube()
    add_pod0(kube, ip="127.0.0.1")

    async def read():
        reader = MetricsReader(kube, "direct", timeout_s=timeout_s)
        try:
            return await reader.read("ml", "job", trainer.port)
        finally:
            await reader.close()

    return asyncio.run(read())


def read_proxy(trainer: Trainer, timeout_s: float = 3.0):
    """Through AsyncKube's pod proxy: the stand-in serves the API server's paths, so the real client code
    (kubernetes_asyncio's ApiClient, its aiohttp session) does the reading."""

    async def read():
        cfg = k8s.Configuration(host=f"http://127.0.0.1:{trainer.port}")
        kube = AsyncKube(k8s.ApiClient(cfg))
        reader = MetricsReader(kube, "proxy", timeout_s=timeout_s)
        try:
            return await reader.read("ml", "job", 9431)
        finally:
            await reader.close()
            await kube.close()

    return asyncio.run(read())


@pytest.mark.parametrize("read", [read_direct, read_proxy], ids=["direct", "proxy"])
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "undeclared"])
def test_a_200_mb_status_is_given_up_after_64_kib(trainers, read, declared):
    trainer = Trainer(huge(declared))
    trainers.append(trainer)
    sample = read(trainer)
    assert sample.error and "64 KiB" in sample.error, sample.error
    assert trainer.done.wait(30), "the stand-in is still sending: the reader did not hang up"
    # What got onto the socket before the reader closed it: the kernel's buffers at most, not 200 MB.
    assert trainer.sent < 32 * 1024 * 1024, trainer.sent


@pytest.mark.parametrize("read", [read_direct, read_proxy], ids=["direct", "proxy"])
def test_a_trickling_status_is_given_up_at_the_deadline(trainers, read):
    trainer = Trainer(trickle)
    trainers.append(trainer)
    sample = read(trainer, timeout_s=0.5)
    assert sample.error and "no complete answer within 0.5 s" in sample.error, sample.error


@pytest.mark.parametrize("read", [read_direct, read_proxy], ids=["direct", "proxy"])
def test_json_nested_too_deep_is_an_error_not_a_crash(trainers, read):
    trainer = Trainer(nested)
    trainers.append(trainer)
    sample = read(trainer)
    assert sample.error and "not JSON" in sample.error, sample.error


def test_a_read_due_while_the_last_is_pending_is_skipped_not_queued(trainers):
    trainer = Trainer(trickle)
    trainers.append(trainer)
    kube = FakeKube()
    add_pod0(kube, ip="127.0.0.1")
    key = ("ml", "job")
    job: dict[str, Any] = {
        "metadata": {"namespace": "ml", "name": "job"},
        "spec": {"runtime": {"metricsPort": trainer.port}},
        "status": {"phase": "Running"},
    }

    async def scenario() -> tuple[list[bool], float, Any]:
        manager, _, _ = manager_for(kube)
        manager.reader = MetricsReader(kube, "direct", timeout_s=1.0)
        manager.jobs = {key: [job]}
        started = [manager.start_read(key) for _ in range(5)]
        await asyncio.gather(*manager.reading)
        await manager.reader.close()
        return started, manager.stats.metrics_reads_skipped._value.get(), manager.samples[key]

    started, skipped, sample = asyncio.run(scenario())
    assert started == [True, False, False, False, False] and skipped == 4
    assert trainer.requests == 1 and "no complete answer" in sample.error
