"""The per-key slot limit on a real Redis: a key gets at most its share, others are not counted
against it, a slot a member already holds is kept, and a lease that nobody releases lapses."""

from __future__ import annotations

import time

from workers.fair_share import KeyShare


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
