"""POST /v1/render's request checks (rendering itself: tests/processors/test_render.py)."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from tests.web.conftest import auth


def image_data_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 120, 240)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def messages(part_uuid) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_data_url()},
                                          "uuid": part_uuid}, {"type": "text", "text": "Describe it."}]}]


@pytest.mark.parametrize("part_uuid", [5, "", "x" * 257, ["a"], {"id": "a"}])
def test_uuid_must_be_a_string_as_in_jobs(client, part_uuid):
    response = client.post("/v1/render", json={"messages": messages(part_uuid)}, headers=auth())
    assert response.status_code == 422, response.get_json()
    body = response.get_json()
    assert body["code"] == "invalid_request" and "messages[0].content[0].uuid" in body["errors"], body
    job = client.post("/v1/jobs", json={"prompt": "<image>", "content_parts": [
        {"type": "image_url", "url": image_data_url(), "uuid": part_uuid}]}, headers=auth())
    assert job.status_code == 422  # /v1/jobs refuses the same uuid
