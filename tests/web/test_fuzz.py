"""Schema-driven fuzzing of every endpoint in /openapi.json: no input may cause a 5xx."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.conftest import empty_db_url
from web.app import create_app
from workers.settings import Settings


@pytest.fixture(scope="module")
def fuzz_schema(redis_url, demo_model_dir, tmp_path_factory):
    url = empty_db_url(redis_url, 4)
    app = create_app(Settings(
        state_dir=tmp_path_factory.mktemp("fuzz"), model=str(demo_model_dir),
        # No worker runs here: POST /generate must answer 202 quickly instead of waiting.
        sync_timeout_max=0.05,
        # Fuzzed URLs must never leave the machine: only a host that does not exist is allowed.
        allowed_media_domains=("media.invalid",),
    ), url)
    return schemathesis.openapi.from_wsgi("/openapi.json", app)


def test_no_input_causes_a_server_error(fuzz_schema):
    # Each operation is fuzzed by hypothesis directly: schemathesis' pytest plugin does not run
    # under pytest 9.
    operations = [result.ok() for result in fuzz_schema.get_all_operations()]
    # /healthz answers 503 by design here: no worker runs in this test.
    operations = [op for op in operations if op.path != "/healthz"]
    assert len(operations) >= 10
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def no_server_error(case):
            if case.path == "/v1/render":
                # A CPU worker renders, and none runs here: a valid render is a 503 by design.
                response = case.call()
                assert response.status_code < 500 or (
                    response.status_code == 503 and response.json()["code"] == "no_cpu_worker"), response.text
                return
            case.call_and_validate(checks=[not_a_server_error])

        no_server_error()
