"""The per-key slot limit on a real Redis: a key gets at most its share, others are not counted
against it, a slot a member already holds is kept, and a lease that nobody releases lapses."""

from __future__ import annotations

import time

from domain.infra.fair_share import KeyShare


def test_one_key_gets_its_share_and_no_more(redis_client):
    share = KeyShare(redis_client, f"test-{time.time_ns()}", per_key=2, lease_s=30)
    assert share.acquire("a", "job-1") and share.acquire("a", "job-2")
    assert not share.acquire("a", "job-3")
    assert share.acquire("b", "job-4"), "another key is not held back by the first key's slots"
    assert share.acquire("a", "job-1"), "a redelivered job keeps the slot it holds"
    share.release("a", "job-1")
    assert share.acquire("a", "job-3") and share.held("a") == 2


def test_a_lease_nobody_releases_lapses(redis_client):
    share = KeyShare(redis_client, f"test-{time.time_ns()}", per_key=1, lease_s=0.3)
    assert share.acquire("a", "killed-task")
    assert not share.acquire("a", "next")
    time.sleep(0.5)
    assert share.acquire("a", "next")


def test_over_the_share_a_message_parks_and_the_release_wakes_it(redis_client):
    share = KeyShare(redis_client, f"test-{time.time_ns()}", per_key=1, lease_s=30)
    published = []

    def publish(*message):
        published.append(message)

    message = {"task": "rollout.preprocess", "kwargs": {"retry_handles": False}, "queue": "preprocess"}
    assert share.acquire_or_park("a", "job-1", args=["job-1"], **message)
    assert not share.acquire_or_park("a", "job-2", args=["job-2"], **message)
    assert not share.acquire_or_park("a", "job-3", args=["job-3"], **message)
    assert share.parked("a") == 2 and not published, "parked, not retried in a loop"
    assert share.acquire_or_park("b", "job-4", args=["job-4"], **message), "another key is not parked"
    share.release("a", "job-1", publish)
    assert published == [("rollout.preprocess", ["job-2"], {"retry_handles": False}, "preprocess")]
    assert share.parked("a") == 1, "one slot freed: one message woken, in order"
    assert share.sweep(publish) == 0, "nothing more to wake while the woken one may take the slot"


def test_the_sweep_wakes_what_lapsed_leases_and_dead_wakers_left(redis_client):
    share = KeyShare(redis_client, f"test-{time.time_ns()}", per_key=1, lease_s=0.3)
    published = []
    message = {"task": "t", "kwargs": {}, "queue": "q"}
    assert share.acquire_or_park("a", "killed", args=["killed"], **message)
    assert not share.acquire_or_park("a", "waiting", args=["waiting"], **message)
    time.sleep(0.5)  # the killed task never releases; its lease lapses
    assert share.sweep(lambda *m: published.append(m)) == 1
    assert published == [("t", ["waiting"], {}, "q")] and share.parked("a") == 0
    # A waker that died between waking and publishing: the entry stays in waking until swept.
    waking = f"rq:share:{share.kind}:waking"
    redis_client.zadd(waking, {'{"task": "t", "args": ["lost"], "kwargs": {}, "queue": "q", "member": "lost"}': 0})
    assert share.sweep(lambda *m: published.append(m)) == 1 and published[-1] == ("t", ["lost"], {}, "q")
    assert redis_client.zcard(waking) == 0
