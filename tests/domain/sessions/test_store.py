"""Sessions' last turns and trajectories in Redis (domain/sessions/store.py) on a real Redis: turns
whose prompts extend the last turn's sequence make one segment (given ids masked 0, sampled 1,
their logprobs and versions), another prompt starts a segment, only the last MAX_SEGMENTS are kept,
keys expire with the results' TTL and one key never reads another's session."""

from __future__ import annotations

import pytest
import redis

from domain.sessions.store import MAX_SEGMENTS, SessionStore
from tests.conftest import empty_db_url


@pytest.fixture
def store(redis_url):
    client = redis.Redis.from_url(empty_db_url(redis_url, 24))
    yield SessionStore(client, ttl=600)
    client.close()


def turn(store, owner, session, prompt, sampled, *, version="v1"):
    last = store.last_turn(owner, session)
    return store.record(owner, session, last, context="c", messages=["m"], returned=["r"], prompt=prompt,
                        sampled=sampled, stop_token=sampled[-1], media=False, logprobs=[-0.5] * len(sampled),
                        weight_versions=[{"version": version, "start": 0, "end": len(sampled)}], how="rendered",
                        reason=None)


def test_extending_turns_make_one_sequence_with_its_mask_logprobs_and_versions(store):
    turn(store, "a", "s", [1, 2, 3], [4, 5])
    last = store.last_turn("a", "s")
    assert (last.prompt, last.sampled, last.stop_token, last.turn) == ([1, 2, 3], [4, 5], 5, 1)
    turn(store, "a", "s", [1, 2, 3, 4, 5, 6, 7], [8], version="v2")
    found = store.trajectory("a", "s")
    assert found["turns"] == 2
    [segment] = found["segments"]
    assert segment["token_ids"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert segment["loss_mask"] == [0, 0, 0, 1, 1, 0, 0, 1]
    assert segment["logprobs"] == [None, None, None, -0.5, -0.5, None, None, -0.5]
    assert segment["weight_versions"] == [None, None, None, "v1", "v1", None, None, "v2"]
    assert [t["sampled_start"] for t in segment["turns"]] == [3, 7]


def test_a_prompt_that_drifts_starts_a_segment_and_old_ones_are_dropped(store):
    turn(store, "a", "s", [1, 2], [3])
    turn(store, "a", "s", [1, 9, 3, 4], [5])  # re-rendered: the sampled 2..3 are not its prefix
    segments = store.trajectory("a", "s")["segments"]
    assert [s["token_ids"] for s in segments] == [[1, 2, 3], [1, 9, 3, 4, 5]]
    for i in range(MAX_SEGMENTS):
        turn(store, "a", "s", [100 + i], [7])
    segments = store.trajectory("a", "s")["segments"]
    assert len(segments) == MAX_SEGMENTS and segments[-1]["token_ids"] == [100 + MAX_SEGMENTS - 1, 7]
    key = SessionStore.key("a", "s")
    assert not store.client.exists(f"{key}:seg:0") and 0 < store.client.ttl(key) <= 600
    assert 0 < store.client.ttl(f"{key}:seg:{MAX_SEGMENTS + 1}") <= 600


def test_another_keys_session_is_not_found(store):
    turn(store, "a", "shared-name", [1], [2])
    assert store.trajectory("b", "shared-name") is None and store.last_turn("b", "shared-name") is None
    assert store.trajectory("a", "shared-name")["turns"] == 1


def test_a_fork_is_the_session_as_it_was_and_branches_apart(store):
    turn(store, "a", "s", [1, 2], [3])
    assert store.fork("a", "s", "t") and not store.fork("a", "gone", "u") and not store.fork("b", "s", "u")
    turn(store, "a", "s", [1, 2, 3, 4], [5])
    turn(store, "a", "t", [1, 2, 3, 6], [7])
    ids = [store.trajectory("a", name)["segments"][0]["token_ids"] for name in ("s", "t")]
    assert ids == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]]
    assert store.client.ttl(store.key("a", "t")) > 0 and store.client.ttl(store.key("a", "t") + ":seg:0") > 0
