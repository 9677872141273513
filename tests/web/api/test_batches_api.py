"""The batch API against a real Redis. No worker runs: where a test needs lines to end, it runs the
chunk task's body and ends jobs through the lifecycle, with the app's services as the runtime."""

from __future__ import annotations

import io
import json

import pytest

from domain.batches.progress import record_lines
from domain.batches.sweeps import cancel_lines
from domain.lifecycle import end_job
from domain.names import BATCHES_QUEUE
from tests.web.conftest import KEY_B, auth
from web.api import batches
from workers.tasks.batches import submit_chunk

RESULT = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": [7], "finish_reason": "length"}]}


def line(custom_id: str, kind: str = "generate", **body) -> dict:
    return {"custom_id": custom_id, "kind": kind,
            "body": body or {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}}


def jsonl(*items) -> bytes:
    return "".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items).encode()


@pytest.fixture
def make_batch_app(make_app):
    def make(**overrides):
        app = make_app(**overrides)
        if "batches" not in app.blueprints:  # until web/app.py registers it
            app.extensions["flask-smorest"]["apis"][""]["ext_obj"].register_blueprint(batches.blp)
        return app

    return make


@pytest.fixture
def app(make_batch_app):
    return make_batch_app()


@pytest.fixture
def client(app):
    return app.test_client()


def upload(client, data: bytes, key=None, content_type="application/jsonl", query=""):
    return client.post(f"/v1/batches{query}", data=data, content_type=content_type, headers=auth(key) if key else auth())


def download(client, batch_id: str, which: str) -> list[dict]:
    response = client.get(f"/v1/batches/{batch_id}/{which}", headers=auth())
    assert response.status_code == 200 and response.mimetype == "application/jsonl"
    return [json.loads(text) for text in response.get_data(as_text=True).splitlines()]


def test_upload_returns_202_and_the_batch_reads_back(client, redis_client):
    response = upload(client, jsonl(*(line(f"r{n}") for n in range(5))))
    assert response.status_code == 202
    batch = response.get_json()
    assert batch["id"].startswith("batch_") and batch["object"] == "batch"
    assert batch["status"] == "in_progress"
    assert batch["request_counts"] == {"total": 5, "completed": 0, "failed": 0}
    assert response.headers["Location"] == batch["links"]["self"] == f"/v1/batches/{batch['id']}"
    assert batch["links"]["output"].endswith("/output") and batch["links"]["errors"].endswith("/errors")
    assert batch["errors"] == {"invalid_lines": 0, "data": []}
    assert client.get(batch["links"]["self"], headers=auth()).get_json() == batch
    assert redis_client.llen(BATCHES_QUEUE) == 2  # one chunk message (5 <= 64 lines) + the expiry check


def test_multipart_upload_takes_the_parameters_from_the_form(client):
    data = {
        "file": (io.BytesIO(jsonl(line("a"), line("b"))), "rollouts.jsonl"),
        "completion_window": "2h",
        "metadata": json.dumps({"experiment": "ppo-7"}),
        "webhook": json.dumps({"url": "https://hooks.example.com/x", "events": ["batch.completed"]}),
    }
    response = client.post("/v1/batches", data=data, content_type="multipart/form-data", headers=auth())
    assert response.status_code == 202, response.get_json()
    batch = response.get_json()
    assert batch["completion_window"] == 7200
    assert batch["expires_at"] == pytest.approx(batch["created_at"] + 7200)
    assert batch["metadata"] == {"experiment": "ppo-7"}
    assert batch["webhook"]["url"] == "https://hooks.example.com/x"


def test_invalid_lines_are_reported_by_number_and_do_not_fail_the_batch(make_batch_app):
    client = make_batch_app(max_model_len=64).test_client()
    data = jsonl(
        line("ok-1"),                                                        # 1
        "{not json",                                                         # 2
        {"kind": "generate", "body": {"token_ids": [1]}},                    # 3 no custom_id
        line("unknown", token_ids=[1], tokens=[2]),                          # 4 unknown field
        line("ok-1"),                                                        # 5 duplicate
        line("score-no-completion", kind="score", token_ids=[1, 2]),         # 6 kind from the line
        "",                                                                  # 7 blank: skipped
        line("kind-wins", kind="generate", token_ids=[1], completion_token_ids=[2]),  # 8 body kind ignored
        line("too-long", token_ids=list(range(60)), sampling_params={"max_tokens": 10}),  # 9
        "[1, 2]",                                                            # 10 not an object
        line("ok-2", kind="score", token_ids=[1, 2], completion_token_ids=[3]),  # 11
        "[" * 100_000 + "]" * 100_000,                                       # 12 nested too deep
    )
    response = upload(client, data)
    assert response.status_code == 202, response.get_json()
    batch = response.get_json()
    assert batch["request_counts"] == {"total": 11, "completed": 0, "failed": 9}
    assert batch["errors"]["invalid_lines"] == 9
    errors = {entry["line"]: entry for entry in download(client, batch["id"], "errors")}
    assert sorted(errors) == [2, 3, 4, 5, 6, 8, 9, 10, 12]
    assert errors[12]["error"]["code"] == "invalid_json"
    assert errors[2] == {"custom_id": None, "line": 2,
                         "error": {"code": "invalid_json", "message": "the line is not valid JSON"}}
    assert "custom_id" in errors[3]["error"]["errors"]
    assert errors[4]["custom_id"] == "unknown" and "tokens" in errors[4]["error"]["errors"]["body"]
    assert "body.tokens" in errors[4]["error"]["message"]
    assert errors[5]["error"]["code"] == "duplicate_custom_id" and errors[5]["custom_id"] == "ok-1"
    assert "completion_token_ids" in errors[6]["error"]["errors"]["body"]
    assert "completion_token_ids" in errors[8]["error"]["errors"]["body"]
    assert errors[9]["error"]["code"] == "context_length_exceeded"
    assert errors[10]["error"]["code"] == "invalid_request"
    assert [e["line"] for e in batch["errors"]["data"]] == [2, 3, 4, 5, 6, 8, 9, 10, 12]
    store = client.application.extensions["rollout"].batches
    stored = [entry for page in store.iter_lines(batch["id"]) for entry in page]
    assert [(entry["line"], entry["custom_id"], entry["request"]["kind"]) for entry in stored] == [
        (1, "ok-1", "generate"), (11, "ok-2", "score")]
    assert stored[0]["request"]["sampling_params"]["max_tokens"] == 2


@pytest.mark.parametrize("data", [jsonl("{bad", line("x", token_ids="no")), b"", b"\n\n"])
def test_a_file_without_a_valid_line_is_422_with_the_first_errors(client, data):
    response = upload(client, data)
    assert response.status_code == 422
    body = response.get_json()
    assert body["code"] == "invalid_batch"
    assert [entry["line"] for entry in body["errors"]] == ([1, 2] if data.strip() else [])
    assert client.get("/v1/batches", headers=auth()).get_json()["data"] == []


def test_size_caps_are_413(make_batch_app):
    client = make_batch_app(batch_max_lines=3, batch_max_bytes=2000).test_client()
    response = upload(client, jsonl(*(line(f"r{n}") for n in range(4))))
    assert response.status_code == 413 and response.get_json()["code"] == "batch_too_large"
    big = jsonl(line("big", token_ids=list(range(600))))
    assert len(big) > 2000
    assert upload(client, big).status_code == 413
    multipart = client.post("/v1/batches", data={"file": (io.BytesIO(big), "f.jsonl")},
                            content_type="multipart/form-data", headers=auth())
    assert multipart.status_code == 413 and multipart.get_json()["code"] == "batch_too_large"
    assert upload(client, jsonl(*(line(f"r{n}") for n in range(3)))).status_code == 202


def test_wrong_content_type_is_415_and_a_missing_file_is_422(client):
    response = client.post("/v1/batches", data="a,b\n", content_type="text/csv", headers=auth())
    assert response.status_code == 415 and response.get_json()["code"] == "unsupported_media_type"
    # JSON is OpenAI's way in: an object naming an uploaded file, not the lines themselves.
    response = client.post("/v1/batches", json=[line("a")], headers=auth())
    assert response.status_code == 422 and response.get_json()["code"] == "invalid_request"
    response = client.post("/v1/batches", data={"metadata": "{}"}, content_type="multipart/form-data", headers=auth())
    assert response.status_code == 422 and "file" in response.get_json()["errors"]


@pytest.mark.parametrize("query, field", [
    ("?completion_window=forever", "completion_window"),
    ("?completion_window=10s", "completion_window"),
    ("?metadata=nope", "metadata"),
    ("?metadata=[1]", "metadata"),
    ('?webhook={"url":"https://h.example.com","events":["job.succeeded"]}', "webhook"),
    ("?colour=blue", "colour"),
])
def test_bad_parameters_are_422_naming_the_field(client, query, field):
    response = upload(client, jsonl(line("a")), query=query)
    assert response.status_code == 422
    assert field in response.get_json()["errors"]


def test_another_key_sees_404(client):
    batch = upload(client, jsonl(line("a"))).get_json()
    for path in ("", "/output", "/errors"):
        response = client.get(f"/v1/batches/{batch['id']}{path}", headers=auth(KEY_B))
        assert response.status_code == 404 and response.get_json()["code"] == "not_found"
    assert client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(KEY_B)).status_code == 404
    assert client.get("/v1/batches/batch_nope", headers=auth()).status_code == 404
    assert client.get("/v1/batches", headers=auth(KEY_B)).get_json()["data"] == []


def test_partial_results_then_cancel_keeps_the_finished_lines(app, client, redis_client):
    svc = app.extensions["rollout"]  # the API's services carry what a worker runtime does
    batch = upload(client, jsonl(*(line(f"r{n}") for n in range(1, 7)))).get_json()
    submit_chunk(svc, batch["id"], 0)
    jobs = svc.batches.line_jobs(batch["id"], [1, 2, 3, 4, 5, 6])
    end_job(svc, jobs[1], "succeeded", result=RESULT)
    end_job(svc, jobs[2], "succeeded", result=RESULT)

    response = client.get(f"/v1/batches/{batch['id']}/output", headers=auth())
    assert response.headers["X-Batch-Status"] == "in_progress"
    assert sorted(entry["custom_id"] for entry in download(client, batch["id"], "output")) == ["r1", "r2"]

    cancelling = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth())
    assert cancelling.status_code == 200 and cancelling.get_json()["status"] == "cancelling"
    assert redis_client.llen(BATCHES_QUEUE) == 3  # chunk, expiry check, and the cancel task
    cancel_lines(svc, batch["id"])  # what the cancel task does
    cancelled = client.get(f"/v1/batches/{batch['id']}", headers=auth()).get_json()
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] >= cancelled["cancelling_at"]
    assert cancelled["request_counts"] == {"total": 6, "completed": 2, "failed": 4}
    output = download(client, batch["id"], "output")
    assert sorted(entry["custom_id"] for entry in output) == ["r1", "r2"]
    assert output[0]["response"] == {"status_code": 200, "body": RESULT}
    assert {entry["error"]["code"] for entry in download(client, batch["id"], "errors")} == {"batch_cancelled"}
    assert svc.jobs.get(jobs[3])["status"] == "cancelled"
    again = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth())
    assert again.status_code == 200 and again.get_json()["status"] == "cancelled"


def test_results_stream_in_pages(app, client):
    svc = app.extensions["rollout"]
    total = 2500
    batch = upload(client, jsonl(*(line(f"r{n}") for n in range(1, total + 1)))).get_json()
    for start in range(1, total + 1, 1000):
        record_lines(svc, batch["id"], [(n, n % 5 != 0, {"custom_id": f"r{n}", "line": n})
                                   for n in range(start, min(start + 1000, total + 1))])
    response = client.get(f"/v1/batches/{batch['id']}/output", headers=auth())
    assert response.is_streamed
    output = download(client, batch["id"], "output")
    errors = download(client, batch["id"], "errors")
    assert len(output) == 2000 and len(errors) == 500
    assert sorted(entry["line"] for entry in output + errors) == list(range(1, total + 1))
    assert client.get(f"/v1/batches/{batch['id']}", headers=auth()).get_json()["status"] == "completed"


def test_list_is_newest_first_with_a_cursor(client):
    made = [upload(client, jsonl(line("a"))).get_json()["id"] for _ in range(3)]
    page = client.get("/v1/batches?limit=2", headers=auth()).get_json()
    rest = client.get(f"/v1/batches?limit=2&cursor={page['next_cursor']}", headers=auth()).get_json()
    assert [b["id"] for b in page["data"] + rest["data"]] == made[::-1]
    assert rest["next_cursor"] is None
    assert client.get("/v1/batches?limit=0", headers=auth()).status_code == 422
    assert client.get("/v1/batches?status=in_progress", headers=auth()).get_json()["data"][0]["id"] == made[-1]


def test_openapi_describes_the_batch_endpoints(client):
    paths = client.get("/openapi.json").get_json()["paths"]
    assert {"/v1/batches", "/v1/batches/{batch_id}", "/v1/batches/{batch_id}/cancel",
            "/v1/batches/{batch_id}/output", "/v1/batches/{batch_id}/errors"} <= set(paths)
    assert "multipart/form-data" in paths["/v1/batches"]["post"]["requestBody"]["content"]


def test_only_a_valid_line_claims_its_custom_id(client):
    data = jsonl(line("a", token_ids="not ids"), line("a"), line("a"), line("b", token_ids=[-1]), line("b"))
    batch = upload(client, data).get_json()
    errors = {entry["line"]: entry["error"]["code"] for entry in download(client, batch["id"], "errors")}
    assert errors == {1: "invalid_request", 3: "duplicate_custom_id", 4: "invalid_request"}
    store = client.application.extensions["rollout"].batches
    stored = [(entry["line"], entry["custom_id"]) for page in store.iter_lines(batch["id"]) for entry in page]
    assert stored == [(2, "a"), (5, "b")]


def test_stored_batch_input_is_capped_per_key(make_batch_app):
    app = make_batch_app(batch_max_stored_bytes_per_key=45_000)
    client = app.test_client()
    svc = app.extensions["rollout"]
    file = jsonl(*(line(f"r{n}") for n in range(60)))  # ~30 KB stored (every line keeps its sampling defaults): one fits, two do not
    first = upload(client, file)
    assert first.status_code == 202, first.get_json()
    second = upload(client, file)
    assert second.status_code == 429 and second.get_json()["code"] == "batch_storage_full"
    assert int(second.headers["Retry-After"]) > 0
    assert [b["id"] for b in client.get("/v1/batches", headers=auth()).get_json()["data"]] == [first.get_json()["id"]]
    assert upload(client, file, key=KEY_B).status_code == 202  # another key has its own allowance
    too_big = upload(client, jsonl(*(line(f"r{n}") for n in range(150))))
    assert too_big.status_code == 413 and too_big.get_json()["code"] == "batch_too_large"
    # Refused while its lines were stored: the batch made for it is gone (part way: tests/domain/batches/test_intake.py).
    assert len(client.get("/v1/batches", headers=auth()).get_json()["data"]) == 1

    svc.batches.release(first.get_json()["id"])  # the first batch ended: its input is gone
    assert upload(client, file).status_code == 202


def test_a_long_poll_answers_when_the_batch_ends_and_wakes_every_waiter(app, client):
    import threading
    import time

    svc = app.extensions["rollout"]
    batch = upload(client, jsonl(line("r1"), line("r2"))).get_json()
    submit_chunk(svc, batch["id"], 0)
    jobs = svc.batches.line_jobs(batch["id"], [1, 2])
    answers: dict[int, tuple[float, dict]] = {}

    def poll(index: int) -> None:
        started = time.monotonic()
        body = app.test_client().get(f"/v1/batches/{batch['id']}?wait=20", headers=auth()).get_json()
        answers[index] = (time.monotonic() - started, body)

    waiters = [threading.Thread(target=poll, args=(i,)) for i in range(3)]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.5)
    end_job(svc, jobs[1], "succeeded", result=RESULT)  # one line left: the waiters keep waiting
    time.sleep(0.3)
    assert not answers
    end_job(svc, jobs[2], "succeeded", result=RESULT)  # the batch's last line ends it
    for waiter in waiters:
        waiter.join(timeout=30)
    assert len(answers) == 3
    for seconds, body in answers.values():
        # Answered ended, with its results files: the batch moves to its end after they exist.
        assert body["status"] == "completed" and body["request_counts"]["completed"] == 2, body
        assert 0.7 < seconds < 10
    assert len(download(client, batch["id"], "output")) == 2


def test_a_long_poll_of_a_running_batch_answers_after_its_wait_with_its_counts(client):
    import time

    batch = upload(client, jsonl(line("r1"))).get_json()
    started = time.monotonic()
    polled = client.get(f"/v1/batches/{batch['id']}?wait=0.3", headers=auth())
    assert polled.status_code == 200 and polled.get_json()["status"] == "in_progress"
    assert 0.25 < time.monotonic() - started < 5
    openai_view = client.get(f"/v1/batches/{batch['id']}?wait=0.3&view=openai", headers=auth())
    assert openai_view.status_code == 200 and openai_view.get_json()["request_counts"]["total"] == 1


@pytest.mark.parametrize("query", ["wait=-1", "wait=soon", "cache_buster=1"])
def test_a_bad_batch_poll_query_is_a_422(client, query):
    batch = upload(client, jsonl(line("r1"))).get_json()
    response = client.get(f"/v1/batches/{batch['id']}?{query}", headers=auth())
    assert response.status_code == 422 and response.get_json()["code"], response.get_json()


def test_a_long_poll_of_another_keys_batch_is_a_404_at_once(client):
    import time

    batch = upload(client, jsonl(line("r1"))).get_json()
    started = time.monotonic()
    assert client.get(f"/v1/batches/{batch['id']}?wait=5", headers=auth(KEY_B)).status_code == 404
    assert time.monotonic() - started < 2
