"""GET /v1/{jobs,batches}/{id}/deliveries, /metrics and /healthz against the API with a real Redis
(no workers run: jobs stay queued). The stores read the numbers; the views only render them."""

from __future__ import annotations

import json
import time

import pytest

from domain.infra.heartbeats import WORKER_KINDS, beat
from domain.infra.metrics import count, observe_stage, record_job_ends
from domain.webhooks import WebhookStore
from tests.web.conftest import KEY_B, auth


def submit_job(client) -> dict:
    response = client.post("/v1/jobs", json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2},
                                             "webhook": {"url": "https://hooks.example.com/x"}}, headers=auth())
    assert response.status_code == 202, response.get_json()
    return response.get_json()


def submit_batch(client) -> dict:
    line = {"custom_id": "r0", "kind": "generate", "body": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}}
    response = client.post("/v1/batches", data=(json.dumps(line) + "\n").encode(), content_type="application/jsonl",
                           headers=auth())
    assert response.status_code == 202, response.get_json()
    return response.get_json()


def test_deliveries_are_shown_to_their_owner_only(client, redis_client):
    job, batch = submit_job(client), submit_batch(client)
    owner = redis_client.hget(f"rq:job:{job['id']}", "owner").decode()
    store = WebhookStore(redis_client, 600)
    for kind, object_id, event in (("job", job["id"], "job.succeeded"), ("batch", batch["id"], "batch.completed")):
        store.create(object_kind=kind, object_id=object_id, owner=owner, event_type=event,
                     url="https://hooks.example.com/x", data={"id": object_id})
    for path in (f"/v1/jobs/{job['id']}/deliveries", f"/v1/batches/{batch['id']}/deliveries"):
        response = client.get(path, headers=auth())
        assert response.status_code == 200
        [delivery] = response.get_json()["data"]
        assert delivery["status"] == "pending" and delivery["attempts"] == []
        assert client.get(path, headers=auth(KEY_B)).status_code == 404
    for path in ("/v1/batches/batch_nope/deliveries", "/v1/batches/batch:x*/deliveries", "/v1/jobs/job_nope/deliveries"):
        assert client.get(path, headers=auth()).status_code == 404


def test_metrics_render_what_the_workers_record(client, redis_client):
    submit_job(client)
    observe_stage(redis_client, "generate", 0.2)
    observe_stage(redis_client, "generate", 0.03, 0.04, 500.0)  # a GPU step's jobs, in one call
    count(redis_client, "mm_cache_hit", 3)
    record_job_ends(redis_client, [{"status": "succeeded", "result": {"transport": "shm"}}, {"status": "failed"}])
    text = client.get("/metrics").get_data(as_text=True)
    assert 'rollout_queue_depth{queue="generate.shared"} 1.0' in text  # token ids without media skip the CPU
    assert "rollout_jobs_active 1.0" in text
    assert 'rollout_jobs_ended_total{status="succeeded"} 1.0' in text
    assert 'rollout_jobs_ended_total{status="failed"} 1.0' in text
    assert 'rollout_events_total{event="mm_cache_hit"} 3.0' in text
    assert 'rollout_events_total{event="transport_shm"} 1.0' in text
    assert 'rollout_stage_seconds_bucket{le="0.025",stage="generate"} 0.0' in text
    assert 'rollout_stage_seconds_bucket{le="0.05",stage="generate"} 2.0' in text
    assert 'rollout_stage_seconds_bucket{le="300.0",stage="generate"} 3.0' in text
    assert 'rollout_stage_seconds_bucket{le="+Inf",stage="generate"} 4.0' in text
    assert 'rollout_stage_seconds_sum{stage="generate"} 500.27' in text
    assert 'rollout_stage_seconds_count{stage="preprocess"} 0.0' in text


def test_healthz_reports_redis_up_and_no_workers(client):
    response = client.get("/healthz")
    assert response.status_code == 503
    body = response.get_json()
    assert body["redis"] == "up" and body["status"] == "degraded"
    assert set(body["workers"].values()) == {"down"} and body["model"] == "down"


def test_metrics_are_served_to_the_scrape_addresses_only(make_app):
    """Its counters move per job (a cache hit on bytes another key sent): not for every caller."""
    client = make_app(metrics_allow_networks=("10.9.0.0/16",)).test_client()
    assert client.get("/metrics", environ_base={"REMOTE_ADDR": "10.9.3.4"}).status_code == 200
    for address in ("10.8.0.1", "127.0.0.1", "203.0.113.9"):
        refused = client.get("/metrics", environ_base={"REMOTE_ADDR": address})
        assert refused.status_code == 403 and refused.get_json()["code"] == "forbidden", address
    assert make_app().test_client().get("/metrics").status_code == 200  # loopback by default


def test_healthz_names_a_worker_that_holds_messages_and_makes_no_progress(client, redis_client):
    """A 503 as for any part down (the load balancer's contract), the worker named with what it holds."""
    for kind in WORKER_KINDS:
        beat(redis_client, kind, "node-a-1", {"held": []})
    now = time.time()
    beat(redis_client, "gpu", "node-a-1", {"model_ready": True, "held": ["t1", "t2"], "progress_at": now})
    assert client.get("/healthz").get_json()["status"] == "ok"
    beat(redis_client, "gpu", "node-a-1", {"model_ready": True, "held": ["t1", "t2"], "progress_at": now - 500})
    response = client.get("/healthz")
    body = response.get_json()
    assert response.status_code == 503 and body["status"] == "degraded" and body["workers"]["gpu"] == "up"
    assert body["stalled_workers"] == {"node-a-1": {"held": 2, "idle_seconds": pytest.approx(500, abs=5)}}
    beat(redis_client, "gpu", "node-a-1", {"model_ready": True, "held": [], "progress_at": now - 500})  # idle
    assert client.get("/healthz").status_code == 200
