"""Webhooks: signing, retry decisions, records, and delivery through a real Celery worker to a real
loopback receiver that verifies every signature with the standardwebhooks library.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from datetime import UTC, datetime
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from domain.jobs.store import JobStore, StoreLimits
from domain.names import DELIVER_TASK, JOB_ENDED_TASK, WEBHOOKS_QUEUE
from domain.settings import Settings
from domain.webhooks import (
    BLOCKED,
    FAILED,
    GONE,
    RETRY_AFTER_CAP_S,
    RETRYING,
    SUCCEEDED,
    Outcome,
    Signer,
    WebhookStore,
    build_payload,
    event_key,
    outcome_of_error,
    outcome_of_status,
    parse_retry_after,
    retry_delay,
    target_url,
    wanted,
)
from domain.webhooks.emit import emit_batch_event, emit_job_event
from workers.celery_app import create_celery
from workers.runtimes import WebhooksRuntime
from workers.tasks.webhooks import run_attempt

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OLD_SECRET = "whsec_" + "c2VjcmV0LW9sZC1rZXktZm9yLXJvdGF0aW9uLXRlc3Q="
OWNER = "key_test"


# --- Pure logic -----------------------------------------------------------------------------------

def test_signer_reproduces_the_spec_test_vector():
    headers = Signer((SECRET,)).headers("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, '{"test": 2432232314}')
    assert headers == {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=",
    }


def test_rotation_sends_every_signature_and_either_secret_verifies():
    now = int(time.time())
    headers = Signer((SECRET, OLD_SECRET)).headers("msg_x", now, '{"a":1}')
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (SECRET, OLD_SECRET):
        assert Webhook(secret).verify('{"a":1}', headers) == {"a": 1}
    with pytest.raises(WebhookVerificationError):
        Webhook("whsec_" + "b3RoZXItc2VjcmV0LW5vdC1jb25maWd1cmVk").verify('{"a":1}', headers)


def test_no_secret_sends_no_signature_header():
    assert "webhook-signature" not in Signer(()).headers("msg_x", 1, "{}")


def test_payload_is_ascii_json_with_a_utc_timestamp():
    payload = build_payload("job.succeeded", {"id": "job_1", "text": "héllo"}, now=1614265330.5)
    assert payload.isascii()
    body = json.loads(payload)
    assert body == {"type": "job.succeeded", "timestamp": "2021-02-25T15:02:10.500Z",
                    "data": {"id": "job_1", "text": "héllo"}}


def test_event_filter_and_default_url():
    settings = Settings(key_webhooks={OWNER: "https://hooks.example/owner"})
    assert wanted(None, "job.failed") and wanted({"url": "x"}, "job.failed")
    assert not wanted({"url": "x", "events": ["job.succeeded"]}, "job.failed")
    assert target_url({"url": "https://a.example/"}, OWNER, settings) == "https://a.example/"
    assert target_url(None, OWNER, settings) == "https://hooks.example/owner"
    assert target_url(None, "someone-else", settings) is None


@pytest.mark.parametrize(("status", "state"), [
    (200, SUCCEEDED), (204, SUCCEEDED), (410, GONE), (429, RETRYING), (500, RETRYING), (503, RETRYING),
    (301, FAILED), (302, FAILED), (400, FAILED), (401, FAILED), (404, FAILED),
])
def test_outcome_of_status(status, state):
    assert outcome_of_status(status, {}, now=0).state == state


def test_outcome_of_errors():
    from processors.fetch import MediaBlockedError, MediaFetchError, MediaRejectedError, MediaTimeoutError

    assert outcome_of_error(MediaBlockedError("no", reason="address")) == Outcome(BLOCKED, None, "webhook_blocked")
    assert outcome_of_error(MediaTimeoutError("slow")) == Outcome(RETRYING, None, "webhook_timeout")
    assert outcome_of_error(MediaFetchError("refused")) == Outcome(RETRYING, None, "webhook_connection_failed")
    assert outcome_of_error(MediaRejectedError("tls")) == Outcome(FAILED, None, "webhook_unreachable")
    assert outcome_of_error(RuntimeError("bug")) == Outcome(RETRYING, None, "internal_error")


def test_retry_after_seconds_date_cap_and_garbage():
    now = 1_700_000_000.0
    assert parse_retry_after("7", now=now) == 7.0
    when = datetime.fromtimestamp(now + 120, tz=UTC)
    assert parse_retry_after(format_datetime(when, usegmt=True), now=now) == pytest.approx(120)
    assert parse_retry_after(format_datetime(datetime.fromtimestamp(now - 5, tz=UTC), usegmt=True), now=now) == 0
    assert parse_retry_after("99999999", now=now) == RETRY_AFTER_CAP_S
    assert parse_retry_after("soon", now=now) is None
    assert parse_retry_after(None, now=now) is None
    # float() reads these, and a NaN wait compares false with every bound.
    assert [parse_retry_after(v, now=now) for v in ("nan", "inf", "-3", "1e3", "\u0663")] == [None] * 5
    assert parse_retry_after(" 2.5 ", now=now) == 2.5
    assert outcome_of_status(503, {"Retry-After": "3"}, now=now).retry_after == 3.0


def test_retry_delay_full_jitter_within_schedule_and_honours_retry_after():
    rng = random.Random(1)
    schedule = (1.0, 10.0, 100.0)
    delays = [retry_delay(3, schedule, rng=rng) for _ in range(200)]
    assert all(0 <= d <= 100 for d in delays) and max(delays) > 50 and min(delays) < 50
    assert retry_delay(1, schedule, retry_after=30.0, rng=rng) == 30.0
    assert retry_delay(4, schedule) is None  # out of retries


# --- Records in Redis -----------------------------------------------------------------------------

@pytest.fixture
def store(redis_client):
    return WebhookStore(redis_client, ttl=300)


def test_one_event_per_end_and_records_expire(store, redis_client):
    first, made = store.create(object_kind="job", object_id="job_a", owner=OWNER, event_type="job.failed",
                               url="https://x.example/", data={"id": "job_a"})
    again, made_again = store.create(object_kind="job", object_id="job_a", owner=OWNER,
                                     event_type="job.failed", url="https://x.example/", data={"id": "job_a"})
    assert made and not made_again and again == first
    assert first.startswith("msg_")
    assert store.event_ids("job", "job_a") == [first]
    store.record(first, 1, Outcome(RETRYING, 500, "webhook_server_error"), 0.01, at=time.time(), next_delay=1)
    for key in redis_client.keys(f"rq:webhook:*{first}*") + redis_client.keys("rq:webhook:*job_a*"):
        assert 0 < redis_client.ttl(key) <= 300


def test_attempt_claim_admits_the_same_message_again_but_not_another(store):
    event_id, _ = store.create(object_kind="job", object_id="job_b", owner=OWNER, event_type="job.succeeded",
                               url="https://x.example/", data={})
    assert not store.claimed(event_id, 1)
    assert store.claim(event_id, 1, "task-1")
    assert store.claim(event_id, 1, "task-1")  # redelivered message after a crash
    assert not store.claim(event_id, 1, "task-2")  # a duplicate message
    assert store.claimed(event_id, 1)


def test_last_retryable_failure_fails_the_event(store):
    event_id, _ = store.create(object_kind="job", object_id="job_c", owner=OWNER, event_type="job.succeeded",
                               url="https://x.example/", data={})
    assert store.record(event_id, 1, Outcome(RETRYING, 503, "webhook_server_error"), 0.2, at=10.0,
                        next_delay=None) == FAILED
    [view] = store.deliveries("job", "job_c")
    assert view["status"] == FAILED and view["completed_at"] == 10.0 and view["next_attempt_at"] is None
    assert view["attempts"] == [{"attempt": 1, "at": 10.0, "status_code": 503, "latency_ms": 200.0,
                                 "error": "webhook_server_error", "outcome": FAILED}]


# --- Real worker, real receiver -------------------------------------------------------------------

class Receiver:
    """A loopback HTTP server. ``script(path, [(status, headers), ...])`` sets the answers a path
    gives in order (the last one repeats); every hit is kept with its verification result."""

    def __init__(self):
        self.hits: list[dict] = []
        self.scripts: dict[str, list[tuple[int, dict]]] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = dict(self.headers.items())
                try:
                    verified = Webhook(SECRET).verify(body, headers)
                except (WebhookVerificationError, ValueError):
                    verified = None
                with receiver.lock:
                    receiver.hits.append({"path": self.path, "headers": headers, "body": body,
                                          "verified": verified, "at": time.time()})
                    script = receiver.scripts.get(self.path) or [(200, {})]
                    status, extra = script.pop(0) if len(script) > 1 else script[0]
                self.send_response(status)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, path: str, answers: list[tuple[int, dict]]) -> str:
        self.scripts[path] = list(answers)
        return self.url(path)

    def hits_for(self, path: str) -> list[dict]:
        with self.lock:
            return [hit for hit in self.hits if hit["path"] == path]


@pytest.fixture(scope="module")
def receiver():
    server = Receiver()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(scope="module")
def webhook_redis_url(redis_url):
    # A database of its own: no other test's worker consumes this module's "webhooks" queue.
    return redis_url.rsplit("/", 1)[0] + "/5"


@pytest.fixture(scope="module")
def settings(receiver, tmp_path_factory):
    return Settings(
        state_dir=tmp_path_factory.mktemp("webhooks"),
        outbound_allow_networks=("127.0.0.0/8",),
        outbound_allowed_ports=(receiver.port,),
        webhook_secrets=(SECRET, OLD_SECRET),
        webhook_retry_schedule=(0.1, 0.2, 0.3),
        webhook_timeout=3.0,
        key_webhooks={"key_default": receiver.url("/owner-default")},
        result_ttl=600,
    )


@pytest.fixture(scope="module")
def celery_app(settings, webhook_redis_url):
    with redis.Redis.from_url(webhook_redis_url) as client:
        client.flushdb()
    app = create_celery(settings, webhook_redis_url)
    app.conf.include = ["workers.tasks.webhooks"]  # this worker serves the webhooks queue only
    app.rollout_runtime_class = WebhooksRuntime
    with start_worker(app, pool="solo", perform_ping_check=False, queues=[WEBHOOKS_QUEUE],
                      shutdown_timeout=20):
        yield app


@pytest.fixture(scope="module")
def rt(settings, webhook_redis_url, celery_app):
    return WebhooksRuntime(settings, webhook_redis_url, celery_app)


def make_job(rt, *, status="succeeded", webhook=None, owner=OWNER) -> dict:
    jobs = JobStore(rt.redis, StoreLimits(1000, 1000, rt.settings.result_ttl))
    job = jobs.create(owner=owner, kind="generate", request={"token_ids": [1, 2]}, request_id="r1",
                      webhook=webhook)
    if status == "succeeded":
        jobs.advance(job["id"], "succeeded", result={"choices": [{"token_ids": [3]}]})
    else:
        jobs.advance(job["id"], status)
    return jobs.get(job["id"])


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out waiting")


def final_deliveries(rt, object_kind, object_id, timeout=10.0):
    store = WebhookStore(rt.redis, rt.settings.result_ttl)

    def done():
        views = store.deliveries(object_kind, object_id)
        return views if views and all(v["status"] not in ("pending", "retrying") for v in views) else None

    return wait_for(done, timeout)


def test_delivery_is_signed_and_carries_the_public_job(celery_app, rt, receiver):
    url = receiver.script("/ok", [(200, {})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    [hit] = receiver.hits_for("/ok")
    assert hit["verified"] is not None, "signature did not verify"
    assert hit["verified"]["type"] == "job.succeeded"
    assert hit["verified"]["data"]["id"] == job["id"] and hit["verified"]["data"]["object"] == "job"
    assert hit["verified"]["data"]["result"] == {"choices": [{"token_ids": [3]}]}
    assert hit["headers"]["webhook-id"] == view["id"]
    assert len(hit["headers"]["webhook-signature"].split(" ")) == 2  # both secrets
    assert abs(int(hit["headers"]["webhook-timestamp"]) - time.time()) < 10
    assert hit["headers"]["Content-Type"] == "application/json"
    assert view["status"] == SUCCEEDED and view["type"] == "job.succeeded"
    [attempt] = view["attempts"]
    assert attempt["status_code"] == 200 and attempt["error"] is None and attempt["latency_ms"] >= 0


def test_flaky_receiver_gets_one_success_and_the_same_id_and_bytes_every_time(celery_app, rt, receiver):
    url = receiver.script("/flaky", [(500, {}), (503, {}), (200, {})])
    job = make_job(rt, status="failed", webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    hits = receiver.hits_for("/flaky")
    assert len(hits) == 3
    assert {hit["headers"]["webhook-id"] for hit in hits} == {view["id"]}
    assert len({hit["body"] for hit in hits}) == 1
    assert all(hit["verified"] is not None for hit in hits)
    assert view["status"] == SUCCEEDED
    assert [(a["status_code"], a["outcome"]) for a in view["attempts"]] == [
        (500, RETRYING), (503, RETRYING), (200, SUCCEEDED)]
    assert view["attempts"][0]["error"] == "webhook_server_error"


def test_retries_run_out_and_the_event_fails(celery_app, rt, receiver):
    url = receiver.script("/down", [(500, {})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    assert view["status"] == FAILED
    assert len(view["attempts"]) == 1 + len(rt.settings.webhook_retry_schedule)
    assert len(receiver.hits_for("/down")) == 4


def test_gone_stops_delivery(celery_app, rt, receiver):
    url = receiver.script("/gone", [(410, {}), (200, {})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    assert view["status"] == GONE and len(view["attempts"]) == 1
    time.sleep(0.5)  # longer than any retry would wait
    assert len(receiver.hits_for("/gone")) == 1


def test_redirect_is_not_followed(celery_app, rt, receiver):
    receiver.script("/target", [(200, {})])
    url = receiver.script("/redirect", [(302, {"Location": receiver.url("/target")})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    assert view["status"] == FAILED
    assert view["attempts"][0]["status_code"] == 302
    assert view["attempts"][0]["error"] == "webhook_redirect_not_followed"
    assert len(receiver.hits_for("/redirect")) == 1
    assert receiver.hits_for("/target") == []


def test_other_4xx_stops(celery_app, rt, receiver):
    url = receiver.script("/bad", [(400, {}), (200, {})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    assert view["status"] == FAILED and [a["status_code"] for a in view["attempts"]] == [400]


def test_retry_after_is_honoured(celery_app, rt, receiver):
    url = receiver.script("/busy", [(429, {"Retry-After": "1"}), (200, {})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    first, second = receiver.hits_for("/busy")
    assert second["at"] - first["at"] >= 1.0
    assert view["status"] == SUCCEEDED
    assert view["attempts"][0]["error"] == "webhook_rate_limited"


def test_job_ended_twice_makes_one_event_and_one_delivery(celery_app, rt, receiver):
    url = receiver.script("/twice", [(200, {})])
    job = make_job(rt, webhook={"url": url})
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    time.sleep(0.5)
    assert len(receiver.hits_for("/twice")) == 1
    assert len(view["attempts"]) == 1
    assert len(WebhookStore(rt.redis, 600).deliveries("job", job["id"])) == 1


def test_with_replica_acks_an_event_is_confirmed_on_the_replicas_before_its_first_delivery(rt, receiver, caplog):
    # This Redis has no replica, so the confirmation times out: the event is delivered anyway.
    settings = rt.settings.replace(redis_replica_acks=1, redis_replica_timeout_ms=20)
    asking = SimpleNamespace(redis=rt.redis, settings=settings, webhooks=rt.webhooks)
    waits = []

    def first_attempt(event_id):
        waits.append(rt.redis.info("commandstats")["cmdstat_wait"]["calls"])

    before = rt.redis.info("commandstats").get("cmdstat_wait", {"calls": 0})["calls"]
    job = make_job(rt, webhook={"url": receiver.url("/replicated")})
    with caplog.at_level(logging.WARNING, logger="domain.webhooks.emit"):
        event_id = emit_job_event(asking, job, first_attempt=first_attempt)
    assert event_id is not None and waits == [before + 1]
    assert f"webhook event {event_id}" in caplog.text  # the warning: not confirmed in time
    assert emit_job_event(asking, job, first_attempt=first_attempt) == event_id  # made once: no second wait
    assert rt.redis.info("commandstats")["cmdstat_wait"]["calls"] == before + 1


def test_events_filter_and_owner_default_url(celery_app, rt, receiver):
    filtered = make_job(rt, status="cancelled", webhook={"url": receiver.url("/ok"), "events": ["job.failed"]})
    assert emit_job_event(rt, filtered, app=celery_app) is None
    assert WebhookStore(rt.redis, 600).deliveries("job", filtered["id"]) == []

    receiver.script("/owner-default", [(200, {})])
    job = make_job(rt, owner="key_default")
    celery_app.send_task(JOB_ENDED_TASK, args=[job["id"]], queue=WEBHOOKS_QUEUE)
    [view] = final_deliveries(rt, "job", job["id"])
    assert view["status"] == SUCCEEDED and view["url"] == receiver.url("/owner-default")
    assert emit_job_event(rt, make_job(rt, owner="key_nobody"), app=celery_app) is None


def test_batch_events_are_made_once_and_delivered(celery_app, rt, receiver):
    from domain.batches.store import BatchStore, public_batch

    batches = BatchStore(rt.redis, result_ttl=600)
    url = receiver.script("/batch", [(200, {})])
    batch = batches.create(owner=OWNER, total=1, chunk_size=1, completion_window=60, webhook={"url": url})
    assert batches.move(batch["id"], "expired", from_=["validating"])
    # The public batch carries no owner: it is read from the batch record.
    event_id = emit_batch_event(rt, public_batch(batches.get(batch["id"])), "batch.expired", app=celery_app)
    [view] = final_deliveries(rt, "batch", batch["id"])
    assert view["id"] == event_id
    [hit] = receiver.hits_for("/batch")
    assert view["type"] == "batch.expired" and view["status"] == SUCCEEDED
    assert hit["verified"]["type"] == "batch.expired"
    assert hit["verified"]["data"] == json.loads(json.dumps(public_batch(batches.get(batch["id"]))))
    # A second call for the same end finds the same event.
    assert emit_batch_event(rt, public_batch(batches.get(batch["id"])), "batch.expired",
                            app=celery_app) == view["id"]
    with pytest.raises(ValueError):
        emit_batch_event(rt, public_batch(batch), "job.succeeded", app=celery_app)
    # No batch webhook and no owner default: nothing.
    quiet = batches.create(owner=OWNER, total=1, chunk_size=1, completion_window=60)
    assert emit_batch_event(rt, public_batch(quiet), "batch.completed", app=celery_app) is None


def test_redelivered_attempt_sends_again_with_the_same_id_but_a_duplicate_does_not(celery_app, rt, receiver):
    url = receiver.script("/crash", [(200, {})])
    store = WebhookStore(rt.redis, 600)
    event_id, _ = store.create(object_kind="job", object_id="job_crash", owner=OWNER,
                               event_type="job.succeeded", url=url, data={"id": "job_crash"})
    # A worker claimed attempt 1 and died before recording it; then a duplicate message arrives.
    assert store.claim(event_id, 1, "task-that-died")
    celery_app.send_task(DELIVER_TASK, args=[event_id], kwargs={"attempt": 1}, queue=WEBHOOKS_QUEUE)
    time.sleep(0.5)
    assert receiver.hits_for("/crash") == []
    # The broker redelivers the dead worker's message: same task id.
    celery_app.send_task(DELIVER_TASK, args=[event_id], kwargs={"attempt": 1}, queue=WEBHOOKS_QUEUE,
                         task_id="task-that-died")
    [view] = final_deliveries(rt, "job", "job_crash")
    [hit] = receiver.hits_for("/crash")
    assert view["status"] == SUCCEEDED and hit["headers"]["webhook-id"] == event_id


def test_guard_refuses_loopback_without_outbound_allow_networks(settings, webhook_redis_url, celery_app, receiver):
    # The guard decision lives in the fetcher the delivery uses, so this drives the delivery body
    # directly with a runtime whose settings allow no internal networks.
    blocked = WebhooksRuntime(settings.replace(outbound_allow_networks=()), webhook_redis_url, celery_app)
    url = receiver.script("/blocked", [(200, {})])
    store = WebhookStore(blocked.redis, 600)
    event_id, _ = store.create(object_kind="job", object_id="job_blocked", owner=OWNER,
                               event_type="job.succeeded", url=url, data={})
    queued: list = []
    state = run_attempt(blocked, event_id, 1, token="t", queue_next=lambda *a: queued.append(a))
    assert state == BLOCKED and queued == []
    [view] = store.deliveries("job", "job_blocked")
    assert view["attempts"][0]["error"] == "webhook_blocked" and view["attempts"][0]["status_code"] is None
    assert receiver.hits_for("/blocked") == []
    # A final event is left alone by any later message.
    assert run_attempt(blocked, event_id, 2, token="t2", queue_next=lambda *a: queued.append(a)) == BLOCKED
    assert len(store.deliveries("job", "job_blocked")[0]["attempts"]) == 1


# --- The deliveries endpoints ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def api(settings, webhook_redis_url, demo_model_dir):
    from web.app import create_app

    app = create_app(settings.replace(api_keys=("key-one", "key-two"), model=str(demo_model_dir)),
                     webhook_redis_url)
    return app.test_client()


def test_deliveries_endpoints_show_attempts_to_the_owner_only(api, rt, receiver):
    from web.auth import key_id

    one, two = {"Authorization": "Bearer key-one"}, {"Authorization": "Bearer key-two"}
    store = WebhookStore(rt.redis, 600)
    job = make_job(rt, owner=key_id("key-one"), webhook={"url": receiver.url("/unused")})
    event_id, _ = store.create(object_kind="job", object_id=job["id"], owner=job["owner"],
                               event_type="job.succeeded", url=receiver.url("/unused"), data={})
    store.record(event_id, 1, Outcome(RETRYING, 503, "webhook_server_error"), 0.05, at=100.0, next_delay=2.0)

    response = api.get(f"/v1/jobs/{job['id']}/deliveries", headers=one)
    assert response.status_code == 200, response.json
    [view] = response.json["data"]
    assert view["id"] == event_id and view["object"] == "webhook_event" and view["status"] == RETRYING
    assert view["next_attempt_at"] == 102.0
    assert view["attempts"] == [{"attempt": 1, "at": 100.0, "status_code": 503, "latency_ms": 50.0,
                                 "error": "webhook_server_error", "outcome": RETRYING}]
    assert api.get(f"/v1/jobs/{job['id']}/deliveries", headers=two).status_code == 404
    assert api.get("/v1/jobs/job_nope/deliveries", headers=one).json["code"] == "not_found"
    assert api.get(f"/v1/jobs/{job['id']}/deliveries").status_code == 401

    rt.redis.hset("rq:batch:batch_api", mapping={"owner": key_id("key-one")})
    store.create(object_kind="batch", object_id="batch_api", owner=key_id("key-one"),
                 event_type="batch.expired", url=receiver.url("/unused"), data={})
    response = api.get("/v1/batches/batch_api/deliveries", headers=one)
    assert response.status_code == 200 and response.json["data"][0]["type"] == "batch.expired"
    assert response.json["data"][0]["attempts"] == []
    assert api.get("/v1/batches/batch_api/deliveries", headers=two).status_code == 404
    assert api.get("/v1/batches/batch_missing/deliveries", headers=one).status_code == 404
    assert "/v1/jobs/{job_id}/deliveries" in api.get("/openapi.json").json["paths"]


def test_a_long_retry_wait_goes_in_hops_shorter_than_the_visibility_timeout(rt, receiver):
    url = receiver.script("/later", [(500, {}), (200, {})])
    store = WebhookStore(rt.redis, 600)
    event_id, _ = store.create(object_kind="job", object_id="job_later", owner=OWNER,
                               event_type="job.succeeded", url=url, data={})
    queued: list = []
    run_attempt(rt, event_id, 1, token="a1", queue_next=lambda *a: queued.append(a))
    # Pretend attempt 2 is due in an hour: a message for it now only waits again, sending nothing.
    rt.redis.hset(event_key(event_id), "next_attempt_at", time.time() + 3600)
    queued.clear()
    state = run_attempt(rt, event_id, 2, token="a2", queue_next=lambda *a: queued.append(a))
    assert state == RETRYING and len(receiver.hits_for("/later")) == 1
    [(attempt, countdown)] = queued
    assert attempt == 2 and 3590 < countdown <= 3600  # deliver() caps each hop at half the visibility timeout


def test_attempts_that_time_out_or_cannot_connect_have_webhook_codes(settings, webhook_redis_url, celery_app):
    """Attempt errors never borrow media codes (media_timeout, media_fetch_failed)."""
    with socket.socket() as hanging, socket.socket() as closed:
        hanging.bind(("127.0.0.1", 0))
        hanging.listen()  # the kernel accepts the connection; nobody ever answers
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        ports = {"timeout": hanging.getsockname()[1], "refused": closed.getsockname()[1]}
        rt = WebhooksRuntime(settings.replace(outbound_allowed_ports=tuple(ports.values()), webhook_timeout=0.5),
                           webhook_redis_url, celery_app)
        store = WebhookStore(rt.redis, 600)
        for name, code in (("timeout", "webhook_timeout"), ("refused", "webhook_connection_failed")):
            event_id, _ = store.create(object_kind="job", object_id=f"job_{name}", owner=OWNER,
                                       event_type="job.succeeded", url=f"http://127.0.0.1:{ports[name]}/hook", data={})
            state = run_attempt(rt, event_id, 1, token="t", queue_next=lambda *a: None)
            [view] = store.deliveries("job", f"job_{name}")
            assert (state, view["attempts"][0]["error"]) == (RETRYING, code)


def test_payload_never_carries_nan_or_infinity():
    payload = build_payload("job.succeeded", {"result": {"logprobs": [float("nan"), -1.5, float("-inf")]}}, now=0)

    def refuse(name):
        raise ValueError(name)

    assert json.loads(payload, parse_constant=refuse)["data"]["result"]["logprobs"] == [None, -1.5, None]
