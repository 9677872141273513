"""Redis away: the API answers the domain's typed store error (503 ``redis_unavailable`` with a
Retry-After), in each route's own shape, and a stream that was open ends with a clean
``interrupted`` event instead of a failure (domain/infra/store_errors.py)."""

from __future__ import annotations

import pytest

from domain.infra.redis_server import EmbeddedRedis
from domain.settings import Settings
from tests.web.conftest import KEY_A, KEY_B, auth
from web.app import create_app

JOB = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


@pytest.fixture
def stoppable(tmp_path, demo_model_dir):
    """An app on a Redis of its own, which the test stops."""
    server = EmbeddedRedis(tmp_path / "redis", persistent=False).start()
    settings = Settings(state_dir=tmp_path, model=str(demo_model_dir), api_keys=(KEY_A, KEY_B),
                        stream_keepalive_seconds=0.2, stream_outage_seconds=0)
    app = create_app(settings, server.url)
    app.config["TESTING"] = True
    yield app, server
    server.stop()


def test_the_native_api_answers_503_with_the_code_while_redis_is_away(stoppable):
    app, server = stoppable
    client = app.test_client()
    job = client.post("/v1/jobs", json=JOB, headers=auth()).get_json()
    server.stop()
    for response in (client.get(f"/v1/jobs/{job['id']}", headers=auth()),
                     client.post("/v1/jobs", json=JOB, headers=auth())):
        assert response.status_code == 503, response.get_json()
        assert response.get_json()["code"] == "redis_unavailable"
        assert response.headers["Retry-After"] == "2"


def test_a_dialect_answers_503_in_its_own_shape_while_redis_is_away(stoppable):
    app, server = stoppable
    client = app.test_client()
    model = client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]
    server.stop()
    response = client.post("/v1/completions", json={"model": model, "prompt": [10, 11], "max_tokens": 2},
                           headers=auth())
    assert response.status_code == 503, response.get_json()
    error = response.get_json()["error"]
    assert (error["code"], error["type"]) == ("redis_unavailable", "server_error")
    assert response.headers["Retry-After"] == "2"


def test_an_open_stream_ends_with_interrupted_when_redis_goes_away(stoppable):
    app, server = stoppable
    client = app.test_client()
    job = client.post("/v1/jobs", json=JOB, headers=auth()).get_json()
    response = client.get(f"/v1/jobs/{job['id']}/events", headers=auth(), buffered=False)
    assert response.status_code == 200
    chunks = iter(response.response)
    first = next(chunks).decode()
    assert "event: status" in first, first  # the job's queued status: the stream is open
    server.stop()
    rest = b"".join(chunks).decode()  # ends by itself: outage bound 0
    response.close()
    assert "event: interrupted" in rest and '"code":"stream_interrupted"' in rest, rest
    assert "event: error" not in rest
