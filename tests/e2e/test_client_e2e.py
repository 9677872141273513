"""The Python client and the batch CLI against the real service over HTTP: API, Celery workers
(CPU, GPU, batches), the tiny demo model."""

from __future__ import annotations

import json
import threading

import pytest
from rollout_queue_client import ClientError, RolloutClient, WaitTimeoutError
from rollout_queue_client.batch_cli import run as run_cli
from werkzeug.serving import make_server

from tests.e2e.conftest import API_KEY
from web.app import create_app

GREEDY = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def service(stack):
    """The stack's API over real HTTP; /v1/generate gives up after 0.3 s so the 202 path is exercised."""
    settings = stack.services.settings.replace(sync_timeout_max=0.3)
    app = create_app(settings, stack.env["ROLLOUT_REDIS_URL"])
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_jobs_submit_wait_cancel(service):
    client = RolloutClient(service, api_key=API_KEY)
    job = client.submit({"token_ids": [100, 101], "sampling_params": GREEDY})
    done = client.wait(job["id"], timeout=60, poll_interval=0.05)
    assert done["status"] == "succeeded" and len(done["result"]["choices"][0]["token_ids"]) == 2
    with pytest.raises(ClientError) as missing:
        client.get("job_missing")
    assert (missing.value.code, missing.value.status) == ("not_found", 404)
    with pytest.raises(ClientError) as unauthorized:
        RolloutClient(service, api_key="wrong").get(job["id"])
    assert unauthorized.value.status == 401
    long = client.submit({"token_ids": [100, 101], "sampling_params": {"max_tokens": 4000, "ignore_eos": True}})
    with pytest.raises(WaitTimeoutError):
        client.wait(long["id"], timeout=0.2, poll_interval=0.05)
    client.cancel(long["id"])
    assert client.wait(long["id"], timeout=60)["status"] == "cancelled"
    looked_up = client.lookup([job["id"], long["id"], "job_missing"], wait=30)
    assert [j["status"] for j in looked_up["data"]] == ["succeeded", "cancelled"]
    assert looked_up["missing"] == ["job_missing"]


def test_a_rollout_step_submitted_in_bulk_runs_as_the_same_jobs_one_by_one(service):
    client = RolloutClient(service, api_key=API_KEY)
    requests = [{"token_ids": [100 + i, 101, 102], "sampling_params": {**GREEDY, "max_tokens": 3}} for i in range(6)]
    requests.append({"kind": "score", "token_ids": [100, 101], "completion_token_ids": [102, 103]})
    jobs = client.submit_many(requests)
    assert len({job["id"] for job in jobs}) == len(requests)
    done = client.wait_many([job["id"] for job in jobs], timeout=60)
    assert [job["status"] for job in done] == ["succeeded"] * len(requests)
    alone = [client.wait(client.submit(request)["id"], timeout=60) for request in (requests[0], requests[-1])]
    assert done[0]["result"]["choices"][0]["token_ids"] == alone[0]["result"]["choices"][0]["token_ids"]
    scored = done[-1]["result"]["completion_logprobs"]
    assert len(scored) == 2 and scored == alone[1]["result"]["completion_logprobs"]


def test_generate_keeps_waiting_after_a_202(service):
    client = RolloutClient(service, api_key=API_KEY)
    out = client.generate({"token_ids": [100, 102], "sampling_params": {"max_tokens": 300, "temperature": 0,
                                                                         "ignore_eos": True}}, timeout=60)
    assert len(out["choices"][0]["token_ids"]) == 300 and out["job_id"].startswith("job_")


def rollout_lines(count: int) -> list[str]:
    """Half generate, half score lines, as an RL pipeline would send them."""
    lines = []
    for n in range(count):
        prompt = [100 + n % 50, 101, 102]
        if n % 2:
            body = {"token_ids": prompt, "completion_token_ids": [110, 111]}
            lines.append(json.dumps({"custom_id": f"r{n}", "kind": "score", "body": body}))
        else:
            lines.append(json.dumps({"custom_id": f"r{n}", "kind": "generate",
                                     "body": {"token_ids": prompt, "sampling_params": GREEDY}}))
    return lines


def test_cli_runs_a_2000_line_mixed_file_with_bad_lines(service, tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    lines = rollout_lines(2000)
    lines.insert(10, '{"custom_id": "broken"')
    lines.insert(20, json.dumps({"custom_id": "r0", "kind": "generate", "body": {"token_ids": [100]}}))
    path.write_text("\n".join(lines) + "\n")
    output, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    status = run_cli(["submit", str(path), "--wait", "--url", service, "--api-key", API_KEY, "--output", str(output),
                      "--errors", str(errors), "--poll-interval", "0.2"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    final = json.loads(captured.out)
    assert final["status"] == "completed"
    assert final["request_counts"] == {"total": 2002, "completed": 2000, "failed": 2}
    results = [json.loads(text) for text in output.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{n}" for n in range(2000))  # each line once
    scored = [r for r in results if int(r["custom_id"][1:]) % 2]
    assert all(len(r["response"]["body"]["completion_logprobs"]) == 2 for r in scored)
    bad = sorted(json.loads(text)["line"] for text in errors.read_text().splitlines())
    assert bad == [11, 21]  # 1-based line numbers of the broken and the duplicate line
    assert "2002/2002" in captured.err  # the progress bar


def test_cancel_midway_keeps_finished_lines(service, tmp_path):
    client = RolloutClient(service, api_key=API_KEY)
    # Twenty short lines end first; the rest are too long to end before the cancel on any machine.
    max_tokens = {f"c{n}": 3 if n < 20 else 2000 for n in range(300)}
    lines = [json.dumps({"custom_id": custom_id, "kind": "generate",
                         "body": {"token_ids": [100, 101], "sampling_params": {"max_tokens": most, "ignore_eos": True}}})
             for custom_id, most in max_tokens.items()]
    batch = client.batch_submit(lines)
    client.batch_wait(batch["id"], timeout=120, poll_interval=0.05,
                      progress=lambda b: b["request_counts"]["completed"] >= 20 and client.batch_cancel(batch["id"]))
    done = client.batch_get(batch["id"])
    assert done["status"] == "cancelled"
    counts = client.batch_download(batch["id"], tmp_path / "o.jsonl", tmp_path / "e.jsonl")
    assert counts["output"] >= 20 and counts["errors"] > 0 and counts["output"] + counts["errors"] == 300
    finished = [json.loads(t) for t in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert all(len(r["response"]["body"]["choices"][0]["token_ids"]) <= max_tokens[r["custom_id"]] for r in finished)


def test_score_lines_scored_directly_match_score_jobs(service, stack, tmp_path):
    client = RolloutClient(service, api_key=API_KEY)
    rows = [{"token_ids": [100 + n, 101, 102], "completion_token_ids": [110 + n, 111]} for n in range(20)]
    batch = client.batch_submit([{"custom_id": f"s{n}", "kind": "score", "body": row} for n, row in enumerate(rows)])
    assert client.batch_wait(batch["id"], timeout=120, poll_interval=0.05)["status"] == "completed"
    client.batch_download(batch["id"], tmp_path / "o.jsonl", tmp_path / "e.jsonl")
    lines = {r["custom_id"]: r for r in map(json.loads, (tmp_path / "o.jsonl").read_text().splitlines())}
    assert len(lines) == 20 and all("job_id" not in line for line in lines.values())  # no job per row
    job = stack.wait(stack.submit({"kind": "score", **rows[3]})["id"])
    direct = lines["s3"]["response"]["body"]
    assert direct["prompt_token_ids"] == job["result"]["prompt_token_ids"]
    for a, b in zip(direct["completion_logprobs"], job["result"]["completion_logprobs"], strict=True):
        assert abs(a - b) < 1e-4
