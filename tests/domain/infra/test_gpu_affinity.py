"""Which GPU worker a generate message goes to (domain/infra/gpu_affinity.py): the one its
prompt's prefix went to, among live workers, unless that one is far busier; and what waits in a
dead worker's own queue is sent again. Real Redis; the workers are heartbeats as the GPU worker
writes them."""

from __future__ import annotations

import json
import re
import time
from collections import Counter

import pytest
import redis

from domain.infra import gpu_affinity
from domain.infra.gpu_affinity import (
    BALANCE_MIN_GAP,
    PREFIX_STEP,
    DirectQueueDrain,
    GpuRouter,
    Placement,
    Worker,
    choose,
    direct_queues,
    prefix_hashes,
    register_direct_queue,
    rendezvous_order,
)
from domain.infra.heartbeats import beat
from domain.infra.intake_order import queue_lists
from domain.names import SHARED_GENERATE_QUEUE, direct_queue, node_generate_queue
from tests.conftest import empty_db_url


@pytest.fixture
def client(redis_url, monkeypatch):
    monkeypatch.setattr(gpu_affinity, "LIVE_REFRESH_S", 0.0)  # each call sees the heartbeats as written
    with redis.Redis.from_url(empty_db_url(redis_url, 18)) as client:
        yield client


def gpu_worker(client, name: str, node: str = "node-a", *, held: int = 0) -> str:
    queue = direct_queue(name)
    register_direct_queue(client, name)
    beat(client, "gpu", name, {"model_ready": True, "node": node, "direct_queue": queue, "held": ["t"] * held})
    return queue


def prompt(seed: int, length: int = 150) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 for i in range(length)]


def test_prefixes_are_named_by_their_tokens_scope_and_media():
    tokens = prompt(1, 3 * PREFIX_STEP + 10)
    names = prefix_hashes("key-a", tokens)
    assert len(names) == 4  # three whole steps and the tail
    assert prefix_hashes("key-a", tokens[:2 * PREFIX_STEP]) == names[:2]  # a prefix names alike
    assert prefix_hashes("key-b", tokens)[0] != names[0]  # two keys never share
    with_image = prefix_hashes("key-a", tokens, media=[(PREFIX_STEP + 3, "sha-of-image")])
    assert with_image[0] == names[0] and with_image[1] != names[1]  # from the piece that holds it on


def test_rendezvous_moves_only_the_keys_of_a_queue_that_leaves():
    queues = [f"q{i}" for i in range(4)]
    before = {key: rendezvous_order(key, queues)[0] for key in map(str, range(400))}
    assert len(set(before.values())) == 4
    after = {key: rendezvous_order(key, queues[:3])[0] for key in before}
    assert all(after[key] == q for key, q in before.items() if q != "q3")


def test_a_prompt_follows_a_deep_enough_routed_prefix_unless_its_worker_is_far_busier():
    workers = [Worker("qa", "n", 0), Worker("qb", "n", 0)]
    names = ["p1", "p2", "p3", "p4"]
    assert choose(names, [None, None, "qb", None], workers) == (workers[1], False)  # 3 of 4 went to qb
    alone = rendezvous_order("p4", ["qa", "qb"])[0]
    assert choose(names, ["qa", None, None, None], workers)[0].queue == alone  # a shared system prompt only
    assert choose(names, [None, None, "qgone", None], workers) == (choose(names, [None] * 4, workers)[0], True)
    busy = [Worker("qa", "n", 0), Worker("qb", "n", BALANCE_MIN_GAP)]
    assert choose(names, [None, None, "qb", None], busy)[0].queue == "qa"
    assert choose(names, [None, None, "qb", None], [Worker("qa", "n", 40), Worker("qb", "n", 100)])[0].queue == "qb"


def test_a_new_prefix_skips_a_worker_that_started_more_than_its_bounded_share():
    names = ["p1"]
    first = rendezvous_order("p1", ["qa", "qb"])[0]
    other = "qb" if first == "qa" else "qa"
    even = [Worker("qa", "n", 0, groups=5), Worker("qb", "n", 0, groups=5)]
    assert choose(names, [None], even)[0].queue == first
    lopsided = [Worker(first, "n", 0, groups=9), Worker(other, "n", 0, groups=3)]  # bound: ceil(1.25 x 13 / 2) = 9
    assert choose(names, [None], lopsided) == (lopsided[1], True)


def test_a_group_and_an_agents_turns_reach_one_worker_and_distinct_prompts_spread(client):
    queues = [gpu_worker(client, f"node-a-{pid}") for pid in (1, 2, 3, 4)]
    router = GpuRouter(client)
    group = [Placement(f"job_{i}", prompt(1), "key-a") for i in range(8)]
    assert len(set(router.queues(group))) == 1  # a GRPO group's samples, in one call
    turn_1 = prompt(2, 300)
    first = router.queues([Placement("job_t1", turn_1, "key-a")])
    turn_2 = turn_1 + prompt(3, 80)  # the history, its completion and a tool's answer
    assert router.queues([Placement("job_t2", turn_2, "key-a")]) == first  # in a later call
    spread = router.queues([Placement(f"job_p{i}", prompt(100 + i), "key-a") for i in range(32)])
    assert set(spread) == set(queues)
    assert max(Counter(spread).values()) <= 11  # bounded: 1.25 x an even share of the 34 groups started


def route_keys(client) -> int:
    return sum(1 for _ in client.scan_iter("rq:affinity:route:*"))


def test_a_prompt_notes_a_few_of_its_prefixes_and_long_shares_still_follow_them(client):
    """A route per step made a 2,000-token prompt 32 keys for 15 minutes (about 170 MB at a queue
    cap of 8,000-token jobs): now a handful, logarithmic in its length, and what the routes are for
    still holds: an agent's next turn after a long history, and a prompt sharing 3/4 of one."""
    for pid in (1, 2, 3, 4):
        gpu_worker(client, f"node-a-{pid}")
    router = GpuRouter(client)
    router.queues([Placement("job_h", prompt(7, 2000), "key-a")])
    assert route_keys(client) == 11  # of 32 prefixes
    router.queues([Placement("job_long", prompt(8, 8000), "key-a")])
    assert route_keys(client) == 11 + 16  # of 125
    for seed in range(20, 26):  # six prompts: each follow-up lands with its prompt, not by chance
        history = prompt(seed, 2000)
        [first] = router.queues([Placement(f"job_{seed}", history, "key-a")])
        assert router.queues([Placement("job_next", history + prompt(seed + 50, 100), "key-a")]) == [first]
        assert router.queues([Placement("job_3q", history[:1500] + prompt(seed + 90, 500), "key-a")]) == [first]
        before = route_keys(client)  # a group's samples after the first note nothing new
        router.queues([Placement(f"job_g{i}", history, "key-a") for i in range(4)])
        assert route_keys(client) == before


def test_an_agents_session_keeps_its_worker_when_its_history_is_cut_and_is_its_keys_alone(client):
    for pid in (1, 2, 3, 4):
        gpu_worker(client, f"node-a-{pid}")
    router = GpuRouter(client)
    [first] = router.queues([Placement("job_t1", prompt(5, 300), "key-a", session="agent-7")])
    # Each next turn keeps only a summary of the history: nothing shared with the turn before, so
    # without the session each would start afresh on the rendezvous choice for its prompt.
    turns = [prompt(50 + turn, 200) for turn in range(12)]
    assert {q for t in turns for q in router.queues([Placement("job_tn", t, "key-a")])} != {first}
    assert {q for t in turns for q in router.queues([Placement("job_ts", t, "key-a", session="agent-7")])} == {first}
    # Another key's session of the same id is its own (its scope is in the route's name).
    other = [router.queues([Placement(f"job_b{i}", prompt(90 + i), "key-b", session="agent-7")])[0] for i in range(12)]
    assert set(other) == {other[0]}
    assert client.exists(Placement("x", [], "key-b", session="agent-7").session_key)


def test_a_session_on_a_worker_far_busier_than_the_rest_moves():
    workers = [Worker("qa", "n", 0), Worker("qb", "n", BALANCE_MIN_GAP)]
    assert choose(["p1"], [None], workers, session="qb")[0].queue == "qa"
    near = [Worker("qa", "n", 0), Worker("qb", "n", 3)]
    assert choose(["p1"], ["qa"], near, session="qb") == (near[1], False)  # the session over a prefix's route
    assert choose(["p1"], [None], workers, session="qgone")[1] is True  # its worker left: a new start


def test_handles_stay_on_their_node_and_no_live_worker_means_the_old_queues(client):
    router = GpuRouter(client)
    assert router.queues([Placement("job_1", prompt(1), "k"), Placement("job_2", prompt(1), "k", node="node-a")]) \
        == [SHARED_GENERATE_QUEUE, node_generate_queue("node-a")]
    gpu_worker(client, "node-a-1", "node-a")
    b = gpu_worker(client, "node-b-1", "node-b")
    assert set(router.queues([Placement(f"job_{i}", prompt(i), "k", node="node-b") for i in range(10)])) == {b}


def test_a_process_reads_the_live_workers_at_most_once_a_refresh(client, monkeypatch):
    monkeypatch.setattr(gpu_affinity, "LIVE_REFRESH_S", 60.0)
    router = GpuRouter(client)
    assert router.queues([Placement("job_1", prompt(1), "k")]) == [SHARED_GENERATE_QUEUE]
    queue = gpu_worker(client, "node-a-1")
    assert router.queues([Placement("job_2", prompt(2), "k")]) == [SHARED_GENERATE_QUEUE]  # read a moment ago
    monkeypatch.setattr(gpu_affinity, "LIVE_REFRESH_S", 0.0)
    assert router.queues([Placement("job_3", prompt(3), "k")]) == [queue]


def test_a_busy_worker_sheds_new_groups_to_an_idle_one(client):
    idle = gpu_worker(client, "node-a-1")
    busy = gpu_worker(client, "node-a-2", held=3 * BALANCE_MIN_GAP)
    queues = GpuRouter(client).queues([Placement(f"job_{i}", prompt(i), "k") for i in range(16)])
    assert busy not in queues and set(queues) == {idle}


def test_a_workers_load_counts_what_waits_at_every_priority_step_of_its_queue(client):
    idle = gpu_worker(client, "node-a-1")
    busy = gpu_worker(client, "node-a-2")
    client.lpush(queue_lists(busy)[5], *[json.dumps({"n": i}) for i in range(3 * BALANCE_MIN_GAP)])  # a deep backlog
    queues = GpuRouter(client).queues([Placement(f"job_{i}", prompt(i), "k") for i in range(16)])
    assert busy not in queues and set(queues) == {idle}


def test_what_waits_in_a_gone_workers_queue_is_sent_again_and_a_live_ones_stays(client, monkeypatch):
    monkeypatch.setattr(gpu_affinity, "REGISTERED_GRACE_S", 0.0)
    live_queue = gpu_worker(client, "node-a-1")
    gone = direct_queue("node-a-2")
    register_direct_queue(client, "node-a-2")  # registered, never beating (or its heartbeat lapsed)
    # a, b at priority step 0 (the queue's own list), e at step 3 (a key's deeper backlog)
    for name, job in ((gone, "job_" + "a" * 22), (gone, "job_" + "b" * 22), (queue_lists(gone)[3], "job_" + "e" * 22),
                      (live_queue, "job_" + "c" * 22)):
        client.lpush(name, json.dumps({"body": "", "headers": {"argsrepr": f"['{job}']"}}))
    sent = []
    time.sleep(0.01)
    drain = DirectQueueDrain(client, lambda job_ids, step: sent.extend((job, step) for job in job_ids),
                             re.compile(rb"job_[A-Za-z0-9_-]{22}"))
    assert drain.sweep() == ["job_" + "a" * 22, "job_" + "b" * 22, "job_" + "e" * 22]
    assert sent == [("job_" + "a" * 22, 0), ("job_" + "b" * 22, 0), ("job_" + "e" * 22, 3)]  # each keeps its step
    assert not any(client.exists(name) for name in queue_lists(gone)) and set(direct_queues(client)) == {live_queue}
    assert client.llen(live_queue) == 1 and drain.sweep() == []


def test_a_starting_workers_queue_waits_and_a_dead_ones_is_watched_while_its_messages_may_come_back(
        client, monkeypatch):
    register_direct_queue(client, "node-a-4")  # starting: registered, not beating yet
    gone = gpu_worker(client, "node-a-3")
    client.delete("rq:worker:gpu:node-a-3")  # its heartbeat lapsed; the index still names it
    time.sleep(0.01)
    drain = DirectQueueDrain(client, lambda job_ids, step: None, re.compile(rb"job_[A-Za-z0-9_-]{22}"))
    assert drain.sweep() == [] and gone in direct_queues(client)
    client.lpush(gone, json.dumps({"headers": {"argsrepr": "['job_" + "d" * 22 + "']"}}))  # given back late
    assert drain.sweep() == ["job_" + "d" * 22]
    assert direct_queue("node-a-4") in direct_queues(client)  # within its start-up grace: left alone
    client.zrem("rq:workers:gpu", "node-a-3")  # past the index's memory (600 s, far past the grace)
    monkeypatch.setattr(gpu_affinity, "REGISTERED_GRACE_S", 0.0)
    assert drain.sweep() == [] and not direct_queues(client)  # and node-a-4 never came up
