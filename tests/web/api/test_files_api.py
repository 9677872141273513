"""/v1/files against a real Redis: upload, read back, stream, list, delete; owned by the key that
uploaded; the batch size cap and the per-key stored-input cap shared with batches."""

from __future__ import annotations

import io
import json

import pytest

from domain.batches.files import CHUNK
from tests.web.conftest import KEY_B, auth


def upload(client, data: bytes, *, key=None, purpose="batch", filename="in.jsonl"):
    form = {"file": (io.BytesIO(data), filename)}
    if purpose is not None:
        form["purpose"] = purpose
    return client.post("/v1/files", data=form, content_type="multipart/form-data", headers=auth(key) if key else auth())


def score_lines(count: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"s{n}", "method": "POST", "url": "/v1/jobs",
                                "body": {"kind": "score", "token_ids": [1, 2, 3],
                                         "completion_token_ids": [4, 5]}}).encode() + b"\n" for n in range(count))


def test_upload_read_list_download_delete(client):
    data = score_lines(3)
    response = upload(client, data, filename="../../etc/rollouts.jsonl")
    assert response.status_code == 200, response.get_json()
    made = response.get_json()
    assert made["id"].startswith("file_") and made["object"] == "file"
    assert made["bytes"] == len(data) and made["purpose"] == "batch" and made["status"] == "processed"
    assert made["filename"] == "rollouts.jsonl"  # the base name only
    assert isinstance(made["created_at"], int) and made["expires_at"] > made["created_at"]
    assert client.get(f"/v1/files/{made['id']}", headers=auth()).get_json() == made
    content = client.get(f"/v1/files/{made['id']}/content", headers=auth())
    assert content.status_code == 200 and content.is_streamed and content.get_data() == data

    other = upload(client, b"{}\n").get_json()
    listed = client.get("/v1/files", headers=auth()).get_json()
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [other["id"], made["id"]]
    assert listed["first_id"] == other["id"] and listed["last_id"] == made["id"] and listed["has_more"] is False
    page = client.get("/v1/files?limit=1", headers=auth()).get_json()
    rest = client.get(f"/v1/files?limit=1&after={page['last_id']}", headers=auth()).get_json()
    assert [f["id"] for f in page["data"] + rest["data"]] == [other["id"], made["id"]]

    deleted = client.delete(f"/v1/files/{made['id']}", headers=auth())
    assert deleted.get_json() == {"id": made["id"], "object": "file", "deleted": True}
    gone = client.get(f"/v1/files/{made['id']}/content", headers=auth())
    assert gone.status_code == 404 and gone.get_json()["error"]["code"] == "not_found"


def test_another_key_gets_404_in_openai_shape(client):
    made = upload(client, score_lines(1)).get_json()
    for method, path in (("get", ""), ("get", "/content"), ("delete", "")):
        response = getattr(client, method)(f"/v1/files/{made['id']}{path}", headers=auth(KEY_B))
        assert response.status_code == 404
        assert response.get_json() == {"error": {"message": f"no file {made['id']!r}", "type": "invalid_request_error",
                                                 "param": None, "code": "not_found"}}
    assert client.get("/v1/files", headers=auth(KEY_B)).get_json()["data"] == []
    # Nor may it run a batch from it.
    response = client.post("/v1/batches", json={"input_file_id": made["id"], "endpoint": "/v1/jobs",
                                                 "completion_window": "24h"}, headers=auth(KEY_B))
    assert response.status_code == 404
    assert client.get(f"/v1/files/{made['id']}", headers=auth()).status_code == 200  # still the owner's
    assert client.get("/v1/files", headers={}).status_code == 401
    assert "error" in client.get("/v1/files", headers={}).get_json()


def test_purpose_and_size_are_checked(make_app):
    client = make_app(batch_max_bytes=1000).test_client()
    refused = upload(client, b"{}\n", purpose="fine-tune")
    assert refused.status_code == 422 and refused.get_json()["error"]["param"] == "purpose"
    assert upload(client, b"{}\n", purpose=None).status_code == 422
    no_file = client.post("/v1/files", data={"purpose": "batch"}, content_type="multipart/form-data", headers=auth())
    assert no_file.status_code == 422 and no_file.get_json()["error"]["param"] == "file"
    big = upload(client, b"x" * 1001)
    assert big.status_code == 413 and big.get_json()["error"]["code"] == "batch_too_large"
    assert upload(client, b"x" * 1000).status_code == 200


def test_files_and_batches_share_the_stored_input_cap(make_app):
    client = make_app(batch_max_stored_bytes_per_key=3000).test_client()
    first = upload(client, b"x" * 2000).get_json()
    full = upload(client, b"x" * 1500)
    assert full.status_code == 429 and full.get_json()["error"]["code"] == "file_storage_full"
    assert full.headers["Retry-After"]
    # A batch's stored lines count with the files: one that needs more than is left is refused too.
    lines = score_lines(2)  # about 1 kB as stored: more than the 1000 bytes left
    batch = client.post("/v1/batches", data=lines, content_type="application/jsonl", headers=auth())
    assert batch.status_code == 429, batch.get_json()
    assert upload(client, b"x" * 900, key=KEY_B).status_code == 200  # another key has its own cap
    client.delete(f"/v1/files/{first['id']}", headers=auth())
    assert upload(client, b"x" * 1500).status_code == 200
    # One file larger than the whole cap can never fit: a 413, not a retryable 429.
    whole = upload(client, b"x" * 3001)
    assert whole.status_code == 413 and whole.get_json()["error"]["code"] == "file_too_large"
    assert "Retry-After" not in whole.headers


def test_large_files_stream_in_chunks(client):
    data = (b'{"custom_id": "x"}\n' * (CHUNK // 5))[: 2 * CHUNK + 17]
    made = upload(client, data).get_json()
    assert made["bytes"] == len(data)
    response = client.get(f"/v1/files/{made['id']}/content", headers=auth())
    parts = list(response.response)
    assert len(parts) == 3 and b"".join(parts) == data


def test_files_list_oldest_first_with_order_asc_and_pages_after_a_file(client):
    made = [upload(client, b"{}\n").get_json()["id"] for _ in range(3)]
    oldest = client.get("/v1/files?order=asc", headers=auth()).get_json()
    assert [f["id"] for f in oldest["data"]] == made and oldest["has_more"] is False
    page = client.get("/v1/files?order=asc&limit=2", headers=auth()).get_json()
    rest = client.get(f"/v1/files?order=asc&limit=2&after={page['last_id']}", headers=auth()).get_json()
    assert [f["id"] for f in page["data"]] == made[:2] and page["has_more"] is True
    assert [f["id"] for f in rest["data"]] == made[2:] and rest["has_more"] is False


@pytest.mark.parametrize("query", ["?limit=0", "?order=random", "?purpose=fine-tune", "?nope=1"])
def test_bad_list_queries_are_422(client, query):
    response = client.get(f"/v1/files{query}", headers=auth())
    assert response.status_code == 422 and response.get_json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("filename", ["rollouts-é中.jsonl", "a\x00b.jsonl", 'q"uote.jsonl'])
def test_any_file_name_downloads_with_an_rfc_6266_header(client, filename):
    """A name with non-ASCII, NUL or CR/LF made its download a 500; it goes as filename* (RFC 5987)."""
    from urllib.parse import unquote

    made = upload(client, score_lines(1), filename=filename).get_json()
    content = client.get(f"/v1/files/{made['id']}/content", headers=auth())
    assert content.status_code == 200, content.get_data()[:200]
    disposition = content.headers["Content-Disposition"]
    assert "\r" not in disposition and "\n" not in disposition and "X-Injected" not in content.headers
    if "filename*=" in disposition:
        name = unquote(disposition.split("filename*=UTF-8''", 1)[1])
        assert name == "".join(ch for ch in made["filename"] if ch.isprintable())
    assert disposition.startswith('attachment; filename="')


def test_the_disposition_of_a_name_with_a_line_break_is_one_header_line():
    from web.api.attachment import attachment

    value = attachment("a\r\nX-Injected: 1\x00é.jsonl")
    assert "\r" not in value and "\n" not in value and "\x00" not in value
    assert value == "attachment; filename=\"aX-Injected: 1e.jsonl\"; filename*=UTF-8''aX-Injected%3A%201%C3%A9.jsonl"
