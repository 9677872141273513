"""The Python client and the batch CLI over real HTTP.

Retries are checked against a scripted loopback server (``http.server`` in a thread); the rest
against the real API served by werkzeug in a thread, with a stand-in worker thread that runs the
chunk task's body and ends jobs through the lifecycle (no model, no Celery worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import deque
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from werkzeug.serving import make_server

from client import ClientError, ConnectionFailedError, RetryPolicy, RolloutClient, WaitTimeoutError
from client.retry import parse_retry_after
from web import batches
from web.app import create_app
from web.auth import key_id
from web.cli_batch import run as run_cli
from workers.batch_progress import batch_store
from workers.lifecycle import end_job
from workers.settings import Settings
from workers.tasks.batches import submit_chunk

KEY = "client-test-key"
PROMPT = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
RESULT = {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "token_ids": [9], "finish_reason": "length"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
FAST = RetryPolicy(backoff=0.01, jitter=0.0)


# --- A scripted server ----------------------------------------------------------------------------

class Scripted:
    """Answers each request with the next scripted (status, headers, body); records what came."""

    def __init__(self):
        self.script: deque = deque()
        self.seen: list[tuple[float, str, str, bytes]] = []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                scripted.seen.append((time.monotonic(), self.command, self.path, body))
                status, headers, payload = scripted.script.popleft() if len(scripted.script) > 1 else scripted.script[0]
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gaps(self) -> list[float]:
        times = [seen[0] for seen in self.seen]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@pytest.fixture
def scripted():
    server = Scripted()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_429_and_503_are_retried_honouring_retry_after(scripted):
    scripted.script.extend([
        (429, {"Retry-After": "1"}, {"code": "queue_full", "message": "too many"}),
        (503, {"Retry-After": "0"}, {"code": "redis_unavailable", "message": "retry"}),
        (202, {}, {"id": "job_1", "status": "queued"}),
    ])
    job = RolloutClient(scripted.url, api_key="k", retry=FAST).submit(PROMPT)
    assert job == {"id": "job_1", "status": "queued"}
    assert [seen[1:3] for seen in scripted.seen] == [("POST", "/v1/jobs")] * 3
    assert json.loads(scripted.seen[2][3]) == PROMPT  # the same body every time
    first, second = scripted.gaps()
    assert first >= 0.95 and second < 0.5


def test_without_retry_after_the_backoff_doubles(scripted):
    scripted.script.extend([(503, {}, b"busy")] * 3 + [(200, {}, {"id": "job_1", "status": "queued"})])
    client = RolloutClient(scripted.url, retry=RetryPolicy(backoff=0.1, jitter=0.0))
    assert client.get("job_1")["id"] == "job_1"
    gaps = scripted.gaps()
    assert len(gaps) == 3
    for gap, expected in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert expected - 0.01 <= gap < expected + 0.3


def test_retries_run_out_into_a_typed_error(scripted):
    scripted.script.append((429, {"Retry-After": "0"}, {"code": "queue_full", "message": "too many unfinished jobs"}))
    with pytest.raises(ClientError) as raised:
        RolloutClient(scripted.url, retry=RetryPolicy(max_retries=2, backoff=0.01)).submit(PROMPT)
    error = raised.value
    assert (error.code, error.status, error.message) == ("queue_full", 429, "too many unfinished jobs")
    assert error.retryable and len(scripted.seen) == 3


def test_error_bodies_become_client_errors(scripted):
    scripted.script.extend([
        (422, {}, {"code": "invalid_request", "message": "invalid fields: tokens", "errors": {"tokens": ["x"]}}),
        (502, {"Content-Type": "text/html"}, b"<html>bad gateway</html>"),
    ])
    client = RolloutClient(scripted.url, retry=FAST)
    with pytest.raises(ClientError) as invalid:
        client.submit({"tokens": [1]})
    assert (invalid.value.code, invalid.value.status, invalid.value.errors) == (
        "invalid_request", 422, {"tokens": ["x"]})
    assert not invalid.value.retryable
    with pytest.raises(ClientError) as gateway:
        client.get("job_1")
    assert (gateway.value.code, gateway.value.status) == ("http_502", 502)


def test_an_unreachable_service_is_a_connection_error(scripted):
    url = scripted.url
    scripted.server.shutdown()
    scripted.server.server_close()
    with pytest.raises(ConnectionFailedError) as raised:
        RolloutClient(url, retry=FAST).submit(PROMPT)
    assert raised.value.code == "connection_error" and raised.value.status is None


def test_retry_after_accepts_seconds_and_http_dates():
    assert parse_retry_after("7") == 7.0
    assert 25 < parse_retry_after(formatdate(time.time() + 30, usegmt=True)) <= 30
    assert parse_retry_after(formatdate(time.time() - 30, usegmt=True)) == 0.0
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    assert RetryPolicy(max_delay=5).delay(1, "3600") == 5


def test_the_client_imports_without_the_service_stack():
    code = ("import sys, client; bad = [m for m in ('flask', 'torch', 'transformers', 'celery', 'web', "
            "'workers', 'processors', 'engine') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- The real API ---------------------------------------------------------------------------------

class Service:
    def __init__(self, app):
        self.app = app
        self.svc = app.extensions["rollout"]  # the services carry what a worker runtime does
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self, **kwargs) -> RolloutClient:
        return RolloutClient(self.url, api_key=KEY, **kwargs)


@pytest.fixture(scope="module")
def service(redis_url, demo_model_dir, tmp_path_factory):
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"), model=str(demo_model_dir), api_keys=(KEY,),
                        sync_timeout_max=0.5, batch_chunk_size=3)
    app = create_app(settings, redis_url)
    if "batches" not in app.blueprints:  # until web/app.py registers it
        app.extensions["flask-smorest"]["apis"][""]["ext_obj"].register_blueprint(batches.blp)
    running = Service(app)
    yield running
    running.server.shutdown()


@pytest.fixture
def worker(service):
    """A stand-in worker: makes the jobs of running batches and ends two lines every 50 ms."""
    stop = threading.Event()
    svc, owner = service.svc, key_id(KEY)

    def loop():
        store = batch_store(svc)
        while not stop.wait(0.05):
            for batch in store.list(owner=owner, status="in_progress", limit=10, cursor=None)[0]:
                for index in range(batch["chunks"]):
                    submit_chunk(svc, batch["id"], index)
                job_ids = store.line_jobs(batch["id"], list(range(1, batch["total"] + 1)))
                ended = store.ended(batch["id"], list(job_ids))
                for line in sorted(set(job_ids) - ended)[:2]:
                    end_job(svc, job_ids[line], "succeeded", result=RESULT)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


def batch_file(tmp_path, lines: int, invalid: int = 0):
    path = tmp_path / "rollouts.jsonl"
    rows = [json.dumps({"custom_id": f"r{n}", "kind": "generate", "body": PROMPT}) for n in range(lines)]
    rows += ['{"custom_id": "broken"'] * invalid
    path.write_text("\n".join(rows) + "\n")
    return path


def test_jobs_submit_get_cancel_wait(service):
    client = service.client()
    job = client.submit(PROMPT)
    assert job["status"] == "queued" and client.get(job["id"])["id"] == job["id"]
    with pytest.raises(WaitTimeoutError):
        client.wait(job["id"], timeout=0.3, poll_interval=0.1)
    assert client.cancel(job["id"])["status"] == "cancelled"
    assert client.wait(job["id"], timeout=1)["status"] == "cancelled"
    with pytest.raises(ClientError) as missing:
        client.get("job_missing")
    assert (missing.value.code, missing.value.status) == ("not_found", 404)
    with pytest.raises(ClientError) as unauthorized:
        RolloutClient(service.url, api_key="wrong").get(job["id"])
    assert unauthorized.value.status == 401


def test_generate_keeps_waiting_after_a_202(service):
    client = service.client()
    finisher = threading.Timer(1.0, lambda: end_job(service.svc, newest_job(service), "succeeded", result=RESULT))
    finisher.start()
    started = time.monotonic()
    out = client.generate(PROMPT, timeout=10)  # the server gives up after 0.5 s (sync_timeout_max)
    finisher.join()
    assert 0.9 < time.monotonic() - started < 5
    assert out["choices"] == RESULT["choices"] and out["prompt_token_ids"] == [1, 2, 3]
    assert out["job_id"] == newest_job(service)


def newest_job(service) -> str:
    jobs, _ = service.svc.jobs.list(owner=key_id(KEY), status=None, limit=1, cursor=None)
    return jobs[0]["id"]


def test_batch_submit_wait_with_progress_and_download(service, worker, tmp_path):
    client = service.client()
    batch = client.batch_submit(batch_file(tmp_path, 7, invalid=1), metadata={"step": 3})
    assert batch["request_counts"] == {"total": 8, "completed": 0, "failed": 1}
    assert batch["errors"]["invalid_lines"] == 1 and batch["metadata"] == {"step": 3}
    seen: list[tuple[str, int]] = []
    done = client.batch_wait(batch["id"], timeout=20, poll_interval=0.05,
                             progress=lambda b: seen.append((b["status"], b["request_counts"]["completed"])))
    assert done["status"] == "completed" and done["request_counts"] == {"total": 8, "completed": 7, "failed": 1}
    assert seen[-1] == ("completed", 7) and len(seen) > 2
    assert [count for _, count in seen] == sorted(count for _, count in seen)
    counts = client.batch_download(batch["id"], tmp_path / "out.jsonl", tmp_path / "err.jsonl")
    assert counts == {"output": 7, "errors": 1}
    output = [json.loads(text) for text in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(entry["custom_id"] for entry in output) == [f"r{n}" for n in range(7)]
    assert output[0]["response"] == {"status_code": 200, "body": RESULT}
    assert [entry["line"] for entry in client.batch_results(batch["id"], "errors")] == [8]
    assert client.batch_list(limit=1)["data"][0]["id"] == batch["id"]


def test_batch_submit_takes_lines_and_cancel_keeps_them(service):
    client = service.client()
    batch = client.batch_submit([{"custom_id": "a", "kind": "generate", "body": PROMPT},
                                 json.dumps({"custom_id": "b", "kind": "generate", "body": PROMPT})],
                                completion_window="1h")
    assert batch["completion_window"] == 3600 and batch["request_counts"]["total"] == 2
    assert client.batch_cancel(batch["id"])["status"] == "cancelling"
    with pytest.raises(ClientError) as refused:
        client.batch_submit([{"custom_id": "a", "body": {"tokens": [1]}}])
    assert refused.value.code == "invalid_batch" and refused.value.errors[0]["line"] == 1


def test_cli_submit_wait_shows_progress_and_writes_both_files(service, worker, tmp_path, capsys):
    output, errors = tmp_path / "o.jsonl", tmp_path / "e.jsonl"
    status = run_cli(["submit", str(batch_file(tmp_path, 5, invalid=2)), "--wait", "--url", service.url,
                      "--api-key", KEY, "--output", str(output), "--errors", str(errors), "--poll-interval", "0.05"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    final = json.loads(captured.out)
    assert final["status"] == "completed" and final["request_counts"] == {"total": 7, "completed": 5, "failed": 2}
    assert "7/7" in captured.err and "failed=2" in captured.err  # the tqdm bar
    assert len(output.read_text().splitlines()) == 5 and len(errors.read_text().splitlines()) == 2

    assert run_cli(["status", final["id"], "--url", service.url, "--api-key", KEY]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == final["id"]
    again = tmp_path / "again.jsonl"
    assert run_cli(["download", final["id"], "--url", service.url, "--api-key", KEY, "--output", str(again),
                    "--errors", str(tmp_path / "again-errors.jsonl")]) == 0
    assert again.read_text().count("\n") == 5
    assert run_cli(["cancel", "batch_missing", "--url", service.url, "--api-key", KEY]) == 2
    assert "not_found" in capsys.readouterr().err
