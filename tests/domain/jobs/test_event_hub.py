"""The event hub (domain/jobs/event_hub.py) on a real Redis: many readers served by one XREAD, a
reader that joins while the read blocks served at once, readers of one job from different
positions, nothing read for jobs nobody follows, and a reader that cannot subscribe told so."""

from __future__ import annotations

import time

import pytest
import redis

from domain.jobs.event_hub import EventHub
from domain.jobs.events import JobEvents
from domain.jobs.follow import Ended, follow

OWNER = "key_owner"


@pytest.fixture
def hubs(events):
    """EventHub(events, **options), closed after the test."""
    made = []

    def make(**options):
        made.append(EventHub(events, **options))
        return made[-1]

    yield make
    for hub in made:
        hub.close()


def new_job(jobs) -> str:
    return jobs.create(owner=OWNER, kind="generate", request={"token_ids": [1]}, request_id=None)["id"]


def tokens(job_id: str, offset: int) -> tuple:
    return job_id, 1, [{"index": 0, "offset": offset, "token_ids": [offset], "finish_reason": None}]


def take(subscription, count: int, timeout: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += subscription.get(0.1) or []
    return got


def xreads(client) -> int:
    return client.info("commandstats").get("cmdstat_xread", {"calls": 0})["calls"]


def test_many_readers_are_served_by_one_read_per_write(jobs, events, hubs, client):
    hub = hubs(block_ms=5000)
    ids = [new_job(jobs) for _ in range(20)]
    readers = [hub.subscribe({job_id: "0"}) for job_id in ids]
    assert all(len(take(reader, 1)) == 1 for reader in readers)  # each job's "queued"
    before = xreads(client)
    for step in range(5):
        events.publish_tokens([tokens(job_id, step) for job_id in ids])  # one write for every job
        for reader, job_id in zip(readers, ids, strict=True):
            [(got_job, event)] = take(reader, 1)
            assert got_job == job_id and event.data["choices"][0]["offset"] == step
    # About a read per write (one more when a write lands while a reply is parsed, or a wake-up
    # comes): never one per reader and write (100).
    assert xreads(client) - before <= 3 * 5


def test_a_reader_that_joins_while_the_read_blocks_is_served_at_once(jobs, events, hubs):
    hub = hubs(block_ms=30_000)
    quiet = new_job(jobs)
    idle = hub.subscribe({quiet: events.all(quiet)[-1].id})  # nothing new there: the hub's read blocks
    time.sleep(0.2)
    job_id = new_job(jobs)
    started = time.monotonic()
    [(got_job, event)] = take(hub.subscribe({job_id: "0"}), 1)
    assert got_job == job_id and event.data == {"status": "queued"}
    assert time.monotonic() - started < 2.0  # not the 30 s the read in progress would block
    idle.close()


def test_a_closed_hub_stops_its_thread(jobs, hubs):
    hub = hubs(block_ms=30_000)
    hub.subscribe({new_job(jobs): "0"})
    thread = hub._thread
    hub.close()
    thread.join(5)
    assert not thread.is_alive()


def test_two_readers_of_one_job_each_get_their_entries_from_their_position(jobs, events, hubs):
    hub = hubs()
    job_id = new_job(jobs)
    events.publish_tokens([tokens(job_id, 0)])
    queued, first_tokens = events.all(job_id)
    from_start, from_middle = hub.subscribe({job_id: "0"}), hub.subscribe({job_id: queued.id})
    assert [event.id for _, event in take(from_start, 2)] == [queued.id, first_tokens.id]
    assert [event.id for _, event in take(from_middle, 1)] == [first_tokens.id]
    events.publish_tokens([tokens(job_id, 1)])
    assert take(from_start, 1)[0][1].id == take(from_middle, 1)[0][1].id == events.all(job_id)[-1].id


def test_a_job_that_ended_is_read_no_more(jobs, hubs):
    hub = hubs()
    job_id = new_job(jobs)
    jobs.advance(job_id, "succeeded", owner=OWNER, result={"choices": []})
    items = list(follow(hub, jobs, {job_id: "0"}, keepalive=1.0))
    assert isinstance(items[-1][1], Ended)
    assert hub._readers == {}  # the hub's next reads leave the job out


def test_a_reader_that_cannot_subscribe_is_told_and_left_out(events):
    unreachable = redis.Redis(port=1, socket_connect_timeout=0.2)
    hub = EventHub(JobEvents(unreachable, ttl=600))
    with pytest.raises(redis.ConnectionError):
        hub.subscribe({"job_x": "0"})
    assert hub._readers == {}
