"""The optional capacity look-up, against a local HTTP endpoint standing in for the Cloud TPU API."""

import json

import pytest

from tests.conftest import tiny_job
from tpu_operator.api.capacity import check_capacity
from tpu_operator.api.validation import parse_job
from tpu_workload.process.metrics import serve_http

pytest.importorskip("google.cloud.tpu_v2", reason="google-cloud-tpu (the `cloud` extra) is not installed")
from google.auth.credentials import AnonymousCredentials  # noqa: E402

TYPES = {
    "acceleratorTypes": [
        {
            "name": "projects/p/locations/us-central1-c/acceleratorTypes/tpu7x-128",
            "type": "tpu7x-128",
            "acceleratorConfigs": [{"type": "TPU7X", "topology": "4x4x4"}],
        },
        {
            "name": "projects/p/locations/us-central1-c/acceleratorTypes/tpu7x-16",
            "type": "tpu7x-16",
            "acceleratorConfigs": [{"type": "TPU7X", "topology": "2x2x2"}],
        },
        {
            "name": "projects/p/locations/us-central1-c/acceleratorTypes/v6e-16",
            "type": "v6e-16",
            "acceleratorConfigs": [{"type": "V6E", "topology": "4x4"}],
        },
    ]
}


@pytest.fixture
def tpu_api():
    requests = []

    def respond(path: str) -> tuple[int, bytes, str]:
        requests.append(path)
        if "/locations/us-central1-c/" in path:
            return 200, json.dumps(TYPES).encode(), "application/json"
        error = {"error": {"code": 404, "message": "zone not found", "status": "NOT_FOUND"}}
        return 404, json.dumps(error).encode(), "application/json"

    server = serve_http(respond, 0, "127.0.0.1")
    yield f"http://127.0.0.1:{server.server_address[1]}", requests
    server.shutdown()


def _check(endpoint, topology="4x4x4", zone="us-central1-c"):
    job = parse_job(
        tiny_job(
            tpu={"generation": "v7x", "topology": topology},
            training={"steps": 1, "globalBatch": 256, "sequenceLength": 128},
        )
    )
    return check_capacity(job, "p", zone, api_endpoint=endpoint, credentials=AnonymousCredentials())


def test_zone_offers_the_slice(tpu_api):
    endpoint, requests = tpu_api
    assert _check(endpoint) == "capacity: us-central1-c offers v7x 4x4x4 (accelerator type tpu7x-128)"
    assert requests[0].startswith("/v2/projects/p/locations/us-central1-c/acceleratorTypes")


def test_zone_lacks_the_slice(tpu_api):
    endpoint, _ = tpu_api
    assert (
        _check(endpoint, topology="4x4x8")
        == "capacity: us-central1-c does not offer v7x 4x4x8; it offers v7x topologies 2x2x2, 4x4x4"
    )


def test_api_error_is_could_not_check(tpu_api):
    endpoint, _ = tpu_api
    assert _check(endpoint, zone="mars-1").startswith("capacity: could not check mars-1: NotFound")


def test_no_server_is_could_not_check():
    assert _check("http://127.0.0.1:9").startswith("capacity: could not check us-central1-c:")
