"""What the fault and weight-update tests do alike: submit with a webhook, watch statuses, and
check that every job ended exactly once (one webhook delivery each)."""

from __future__ import annotations

import json
import time
from collections import Counter


def submit_all(stack, bodies, hook_path: str) -> list[str]:
    hook = {"url": stack.host.url(hook_path)}
    return [stack.submit({**body, "webhook": hook})["id"] for body in bodies]


def statuses(stack, ids) -> list[str]:
    return [job["status"] for job in stack.services.jobs.get_many(ids)]


def wait_until(predicate, timeout: float, what: str):
    """``predicate()``'s first truthy value, polled until ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def webhook_counts(host, ids, hook_path: str) -> Counter:
    wanted = set(ids)
    counts = Counter()
    for _method, _headers, body in list(host.requests[hook_path]):
        job_id = json.loads(body)["data"]["id"]
        if job_id in wanted:
            counts[job_id] += 1
    return counts


def assert_one_webhook_each(host, ids, hook_path: str) -> None:
    wait_until(lambda: len(webhook_counts(host, ids, hook_path)) == len(ids), 30, "one webhook per job")
    time.sleep(1.0)  # a duplicate would follow within the retry schedule's first steps
    counts = webhook_counts(host, ids, hook_path)
    assert counts == Counter(dict.fromkeys(ids, 1)), counts


def assert_one_event_each(host, ids, hook_path: str) -> int:
    """Every job's end was delivered, as one event: all its deliveries carry one ``webhook-id``
    (what a receiver dedupes by). A delivery whose record a failover lost is sent again, under
    the same id. Returns the number of repeated deliveries."""
    wait_until(lambda: len(webhook_counts(host, ids, hook_path)) == len(ids), 30, "a webhook per job")
    time.sleep(1.0)  # a repeat would follow within the retry schedule's first steps
    wanted = set(ids)
    events: dict[str, set[str]] = {}
    deliveries = 0
    for _method, headers, body in list(host.requests[hook_path]):
        job_id = json.loads(body)["data"]["id"]
        if job_id in wanted:
            events.setdefault(job_id, set()).add({k.lower(): v for k, v in headers.items()}["webhook-id"])
            deliveries += 1
    assert {job_id: len(ids_) for job_id, ids_ in events.items()} == dict.fromkeys(ids, 1)
    return deliveries - len(ids)
