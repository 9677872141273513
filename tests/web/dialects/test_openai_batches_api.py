"""OpenAI's batches (a JSON create naming a /v1/files file) against a real Redis, no workers: the
chunk task's body runs here and jobs end through the lifecycle, as in test_batches_api. The
official client drives the same routes end to end in tests/e2e/test_openai_batches_e2e.py."""

from __future__ import annotations

import io
import json

from domain.lifecycle import end_job
from tests.web.api.test_batches_api import jsonl, line
from tests.web.conftest import auth
from workers.tasks.batches import submit_chunk

CHAT_RESULT = {"prompt_token_ids": [1, 2, 3], "usage": {"prompt_tokens": 3, "completion_tokens": 2},
               "choices": [{"index": 0, "token_ids": [7, 8], "logprobs": [-0.5, -0.25], "top_logprobs": [[], []],
                            "finish_reason": "length", "matched_stop": None, "text": "hi"}]}


def model_name(client) -> str:
    return client.get("/v1/models", headers=auth()).get_json()["data"][0]["id"]


def request_line(custom_id: str, url: str, body: dict, method: str = "POST") -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def upload_file(client, data: bytes) -> str:
    response = client.post("/v1/files", data={"file": (io.BytesIO(data), "in.jsonl"), "purpose": "batch"},
                           content_type="multipart/form-data", headers=auth())
    assert response.status_code == 200, response.get_json()
    return response.get_json()["id"]


def create(client, file_id: str, endpoint: str = "/v1/chat/completions", **extra):
    return client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                            "completion_window": "24h", **extra}, headers=auth())


def content(client, file_id: str) -> list[dict]:
    response = client.get(f"/v1/files/{file_id}/content", headers=auth())
    assert response.status_code == 200, response.get_json()
    return [json.loads(text) for text in response.get_data(as_text=True).splitlines()]


def test_mixed_file_runs_valid_lines_and_writes_openai_results(client):
    model = model_name(client)
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "logprobs": True}
    data = jsonl(
        request_line("chat-1", "/v1/chat/completions", chat),                                         # 1 runs
        request_line("cmpl", "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}),    # 2 endpoint
        request_line("bad-body", "/v1/chat/completions", {"model": model, "messages": [], "nope": 1}),  # 3 422
        "{not json",                                                                                    # 4
        request_line("get", "/v1/chat/completions", chat, method="GET"),                               # 5 method
        request_line("other-model", "/v1/chat/completions", {**chat, "model": "gpt-4o"}),              # 6 404
        line("native-line"),                                                                            # 7 /v1/jobs
        request_line("chat-2", "/v1/chat/completions", {**chat, "logprobs": False}),                   # 8 runs
        request_line("embed", "/v1/embeddings", {"model": model, "input": "x"}),                       # 9 unserved
    )
    file_id = upload_file(client, data)
    response = create(client, file_id, metadata={"run": "7"})
    assert response.status_code == 202, response.get_json()
    batch = response.get_json()
    assert batch["object"] == "batch" and batch["endpoint"] == "/v1/chat/completions"
    assert batch["input_file_id"] == file_id and batch["completion_window"] == "24h"
    assert batch["status"] == "in_progress" and isinstance(batch["created_at"], int)
    assert batch["request_counts"] == {"total": 9, "completed": 0, "failed": 7}
    assert batch["output_file_id"] is None and batch["metadata"] == {"run": "7"}
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [
        (2, "endpoint_mismatch"), (3, "invalid_request"), (4, "invalid_json"), (5, "invalid_line"),
        (6, "model_not_found"), (7, "endpoint_mismatch"), (9, "unsupported_url")]
    assert "links" not in batch and client.get(f"/v1/batches/{batch['id']}", headers=auth()).get_json() == batch

    svc = client.application.extensions["rollout"]
    submit_chunk(svc, batch["id"], 0)
    jobs = svc.batches.line_jobs(batch["id"], [1, 8])
    job = svc.jobs.get(jobs[1])
    assert job["request"]["sampling_params"]["max_tokens"] == 2 and job["request"]["sampling_params"]["logprobs"]
    end_job(svc, jobs[1], "succeeded", result=CHAT_RESULT)
    end_job(svc, jobs[8], "failed", error={"code": "media_error", "message": "could not fetch"})
    done = client.get(f"/v1/batches/{batch['id']}", headers=auth()).get_json()
    assert done["status"] == "completed" and done["completed_at"] >= done["finalizing_at"]
    assert done["request_counts"] == {"total": 9, "completed": 1, "failed": 8}

    (output,) = content(client, done["output_file_id"])
    assert output["custom_id"] == "chat-1" and output["error"] is None
    assert output["response"]["status_code"] == 200 and output["response"]["request_id"] == jobs[1]
    body = output["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == model
    assert body["choices"][0]["message"]["content"] == "hi" and body["choices"][0]["finish_reason"] == "length"
    assert [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]] == [-0.5, -0.25]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}

    errors = {entry["custom_id"]: entry for entry in content(client, done["error_file_id"])}
    assert set(errors) == {"cmpl", "bad-body", None, "get", "other-model", "native-line", "chat-2", "embed"}
    # Lines that never ran: an error, no response (as OpenAI writes them).
    for custom_id, code in (("cmpl", "endpoint_mismatch"), ("get", "invalid_line"), (None, "invalid_json"),
                            ("native-line", "endpoint_mismatch"), ("embed", "unsupported_url")):
        assert errors[custom_id]["response"] is None and errors[custom_id]["error"]["code"] == code
    # Requests the route refused or that failed: the status and OpenAI's error body.
    refused = errors["bad-body"]
    assert refused["error"] is None and refused["response"]["status_code"] == 422
    assert refused["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert errors["other-model"]["response"]["status_code"] == 404
    failed = errors["chat-2"]["response"]
    assert failed["status_code"] == 422 and failed["request_id"] == jobs[8]  # media_error's own status
    assert failed["body"]["error"]["code"] == "media_error"
    assert all(entry["id"].startswith("batch_req_") for entry in errors.values())

    record = client.get(f"/v1/files/{done['output_file_id']}", headers=auth()).get_json()
    assert record["purpose"] == "batch_output"
    assert record["bytes"] == len(client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth()).get_data())
    # Our own download of the same batch keeps our format.
    native = client.get(f"/v1/batches/{batch['id']}/output", headers=auth()).get_json(force=True)
    assert native["custom_id"] == "chat-1" and native["response"] == {"status_code": 200, "body": CHAT_RESULT}


def test_views_coexist_and_list_pages_with_after(client):
    native = client.post("/v1/batches", data=jsonl(line("a")), content_type="application/jsonl",
                         headers=auth()).get_json()
    file_id = upload_file(client, jsonl(request_line("s", "/v1/jobs", {"kind": "score", "token_ids": [1, 2],
                                                                       "completion_token_ids": [3]})))
    made = create(client, file_id, endpoint="/v1/jobs").get_json()
    assert made["endpoint"] == "/v1/jobs" and "links" in native and "endpoint" not in native

    as_openai = client.get(f"/v1/batches/{native['id']}?view=openai", headers=auth()).get_json()
    assert as_openai["endpoint"] == "/v1/jobs" and as_openai["input_file_id"] is None
    assert as_openai["completion_window"] == "24h" and as_openai["created_at"] == int(native["created_at"])
    as_native = client.get(f"/v1/batches/{made['id']}?view=native", headers=auth()).get_json()
    assert as_native["completion_window"] == 86400 and as_native["errors"] == {"invalid_lines": 0, "data": []}
    assert client.get(f"/v1/batches/{made['id']}?view=xml", headers=auth()).status_code == 422

    page = client.get("/v1/batches?limit=1", headers=auth()).get_json()
    assert page["object"] == "list" and page["has_more"] is True and page["first_id"] == made["id"]
    assert page["data"][0]["endpoint"] == "/v1/jobs"  # each batch in its own view
    rest = client.get(f"/v1/batches?limit=1&after={page['last_id']}", headers=auth()).get_json()
    assert [b["id"] for b in rest["data"]] == [native["id"]] and "links" in rest["data"][0]
    assert client.get("/v1/batches?after=batch_nope", headers=auth()).status_code == 404

    cancelled = client.post(f"/v1/batches/{made['id']}/cancel", headers=auth()).get_json()
    assert cancelled["status"] == "cancelling" and isinstance(cancelled["cancelling_at"], int)


def test_create_refuses_what_it_cannot_run(client):
    file_id = upload_file(client, jsonl(line("a")))
    assert create(client, "file_nope").status_code == 404
    bad = create(client, file_id, endpoint="/v1/embeddings")
    assert bad.status_code == 422 and "endpoint" in bad.get_json()["errors"]
    assert create(client, file_id, completion_window="1y").status_code == 422
    # Every line's url is wrong for this endpoint: nothing to run.
    refused = create(client, file_id, endpoint="/v1/chat/completions")
    assert refused.status_code == 422 and refused.get_json()["errors"][0]["error"]["code"] == "endpoint_mismatch"
    results = client.get("/v1/files?purpose=batch_output", headers=auth()).get_json()
    assert results["data"] == []
