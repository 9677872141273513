"""The job store on its own, against a real Redis: records, forward-only moves, the caps on
unfinished jobs, the prompt blob, cancel flags, waiting and listing."""

from __future__ import annotations

import threading
import time

import orjson
import pytest

from domain.infra.redis_records import StoredJSON
from domain.jobs.keys import TOTAL_ACTIVE_KEY, WEBHOOK_OWED_KEY
from domain.jobs.store import JobStore, QueueFullError, StoreLimits
from engine.errors import InternalError, NotFoundError
from tests.conftest import empty_db_url
from workers.gpu.jobs import poll_running

OWNER, OTHER = "key_owner", "key_other"
REQUEST = {"kind": "generate", "token_ids": [1, 2, 3]}


@pytest.fixture
def store(redis_url):
    import redis

    client = redis.Redis.from_url(empty_db_url(redis_url, 12))
    yield JobStore(client, StoreLimits(max_active_per_owner=3, max_active_total=5, result_ttl=600))
    client.close()


def create(store: JobStore, owner: str = OWNER, **kwargs) -> dict:
    return store.create(owner=owner, kind="generate", request=REQUEST, request_id=kwargs.pop("request_id", None),
                        **kwargs)


def test_create_returns_what_get_reads_back(store):
    job = create(store, request_id="r1", webhook={"url": "https://hooks.example.com"}, metadata={"step": 7},
                 extra={"batch_id": "batch_x"})
    assert job["id"].startswith("job_") and len(job["id"]) > 20
    assert job["status"] == "queued" and job["request"] == REQUEST
    assert store.get(job["id"]) == job
    assert job["metadata"] == {"step": 7} and job["batch_id"] == "batch_x"


def test_another_owner_and_implausible_ids_are_not_found(store):
    job = create(store)
    assert store.get(job["id"], owner=OWNER)["id"] == job["id"]
    with pytest.raises(NotFoundError):
        store.get(job["id"], owner=OTHER)
    for bad in ("", "x" * 65, "job_1:prompt", "job_*"):
        with pytest.raises(NotFoundError):
            store.get(bad)


def test_check_owner_says_what_get_says_without_reading_the_record(store):
    job = create(store)
    store.check_owner(job["id"], OWNER)
    for job_id, owner in ((job["id"], OTHER), ("job_gone", OWNER), ("job_*", OWNER), ("", "")):
        with pytest.raises(NotFoundError):
            store.check_owner(job_id, owner)


def test_status_moves_forward_only_and_ends_once(store):
    job = create(store)
    assert store.advance(job["id"], "generating", owner=OWNER)
    assert not store.advance(job["id"], "preprocessing", owner=OWNER)  # backwards
    assert not store.advance(job["id"], "generating", owner=OWNER)  # already there
    assert store.advance(job["id"], "succeeded", result={"choices": []})  # owner looked up
    assert not store.advance(job["id"], "failed", owner=OWNER)
    assert not store.advance(job["id"], "cancelled", owner=OWNER)
    ended = store.get(job["id"])
    assert ended["status"] == "succeeded" and ended["result"] == {"choices": []}
    assert ended["started_at"] is not None and ended["completed_at"] >= ended["started_at"]
    assert store.redis.ttl(store.key(job["id"])) > 0  # kept for result_ttl, then gone


def test_caps_count_unfinished_jobs_exactly(store):
    jobs = [create(store) for _ in range(3)]
    with pytest.raises(QueueFullError) as per_owner:
        create(store)
    assert per_owner.value.headers == {"Retry-After": "5"}
    create(store, owner=OTHER)
    create(store, owner=OTHER)
    with pytest.raises(QueueFullError, match="service"):
        create(store, owner="key_third")
    assert store.active_counts() == 5
    # Ending a job frees its place; ending it again (a redelivery) frees nothing more.
    assert store.fail(jobs[0]["id"], InternalError("boom"))
    assert not store.fail(jobs[0]["id"], InternalError("boom"))
    assert store.active_counts() == 4 and store.active_count(OWNER) == 2
    create(store)
    assert int(store.redis.get(TOTAL_ACTIVE_KEY)) == 5


def test_fail_stores_the_typed_error(store):
    job = create(store)
    store.fail(job["id"], InternalError("internal error while generating"))
    ended = store.get(job["id"])
    assert ended["status"] == "failed"
    assert ended["error"] == {"code": "internal_error", "message": "internal error while generating"}


def test_the_prompt_lives_until_the_job_ends(store):
    plain = create(store, prompt='{"token_ids": [1, 2, 3]}')
    later = create(store)
    assert store.prompts([plain["id"], later["id"]]) == [b'{"token_ids": [1, 2, 3]}', None]
    store.save_prompt(later["id"], '{"token_ids": [4]}')
    assert store.prompts([later["id"]]) == [b'{"token_ids": [4]}']
    assert 0 < store.redis.ttl(store.prompt_key(later["id"])) <= 600
    store.advance(plain["id"], "cancelled", owner=OWNER)
    assert store.prompts([plain["id"], later["id"]]) == [None, b'{"token_ids": [4]}']


def test_cancel_flags_are_per_job_and_cleared_at_the_end(store):
    first, second = create(store), create(store)

    def cancelled(*jobs):
        return poll_running(store.redis, [job["id"] for job in jobs], [])[0]

    assert cancelled(first, second) == set()
    assert cancelled() == set()
    store.request_abort(second["id"])
    assert cancelled(first, second) == {second["id"]}
    store.advance(second["id"], "cancelled", owner=OWNER)
    assert cancelled(second) == set()


def test_the_end_of_a_job_with_a_webhook_records_its_debt_in_the_same_move(store):
    """The job's own webhook, or its owner's key-wide one; none for the rest, and none before the end."""
    keywide_store = JobStore(store.redis, store.limits, hooked_owners=frozenset({OTHER}))
    own, keywide, plain = create(store, webhook={"url": "https://hooks.example.com/a"}), create(store, OTHER), create(store)
    for job in (own, keywide, plain):
        assert keywide_store.advance(job["id"], "generating", owner=job["owner"])
    assert store.redis.zcard(WEBHOOK_OWED_KEY) == 0
    for job in (own, keywide, plain):
        assert keywide_store.advance(job["id"], "succeeded", owner=job["owner"], result={})
    assert {member.decode() for member in store.redis.zrange(WEBHOOK_OWED_KEY, 0, -1)} == {own["id"], keywide["id"]}
    store.redis.zrem(WEBHOOK_OWED_KEY, own["id"])  # its event was made (WebhookStore.settle)
    assert not keywide_store.advance(own["id"], "failed", owner=OWNER)  # a second end moves nothing
    assert store.redis.zscore(WEBHOOK_OWED_KEY, own["id"]) is None


def test_a_users_big_integers_read_back_exact_and_a_result_as_written(store):
    """A result is read with orjson (the service's own numbers); what a user sent, which may hold an
    integer past 64 bits that orjson would read as a float, is not."""
    big = 2**70 + 1
    job = create(store, metadata={"step": big}, request_id="r")
    result = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [7], "logprobs": [-0.25],
                                                      "finish_reason": "length", "text": "é"}], "usage": {"n": 3}}
    store.advance(job["id"], "failed", owner=OWNER, result=result,
                  error={"code": "token_id_out_of_range", "message": "m", "errors": {"token_id": big}})
    read = store.get(job["id"])
    assert read["metadata"] == {"step": big} and type(read["metadata"]["step"]) is int
    assert read["error"]["errors"]["token_id"] == big and read["result"] == result


def test_a_result_read_as_stored_is_its_bytes_and_the_rest_reads_as_get_reads_it(store):
    done, running = create(store, metadata={"step": 2**70}), create(store)
    result = {"choices": [{"index": 0, "token_ids": [7], "logprobs": [-1e-05], "text": "é"}]}
    store.advance(done["id"], "succeeded", owner=OWNER, result=result)
    stored, unfinished = store.get_many([done["id"], running["id"]], stored_result=True)
    assert isinstance(stored["result"], StoredJSON) and unfinished.get("result") is None
    assert stored["result"].data == store.redis.hget(store.key(done["id"]), "result")
    assert orjson.loads(stored["result"].data) == result
    assert {**stored, "result": result} == store.get(done["id"])


def test_advance_each_moves_many_in_one_call(store):
    first, second = create(store), create(store)
    moved = store.advance_each([(first["id"], OWNER, "succeeded", {"result": {"n": 1}}),
                                (second["id"], OWNER, "queued", {})])
    assert moved == [True, False]
    assert store.advance_many([(first["id"], OWNER), (second["id"], OWNER)], "generating") == [False, True]
    assert store.advance_each([]) == []
    assert store.get_many([first["id"], "job_gone"])[1] is None


def test_wait_wakes_when_the_job_ends(store):
    job = create(store)
    assert store.wait(job["id"], timeout=0) is None
    ender = threading.Timer(0.3, lambda: store.advance(job["id"], "succeeded", owner=OWNER))
    ender.start()
    started = time.monotonic()
    ended = store.wait(job["id"], timeout=20)
    assert ended["status"] == "succeeded" and time.monotonic() - started < 10
    assert store.wait(job["id"], timeout=5)["status"] == "succeeded"  # already ended: at once
    other = create(store)
    assert store.wait(other["id"], timeout=0.2) is None


def test_wait_any_wakes_on_the_first_end_among_many_and_returns_those_ended(store):
    jobs = [create(store) for _ in range(3)]
    ids = [job["id"] for job in jobs]
    assert store.wait_any(ids, timeout=0) == {}
    assert store.wait_any([], timeout=0.2) == {}  # nothing to wait for: at once
    assert store.wait_any(ids, timeout=0.2) == {}  # none ends: after the timeout
    ender = threading.Timer(0.3, lambda: store.advance(ids[2], "succeeded", owner=OWNER, result={"n": 2}))
    ender.start()
    started = time.monotonic()
    ended = store.wait_any(ids, timeout=20)
    assert list(ended) == [ids[2]] and ended[ids[2]]["result"] == {"n": 2} and time.monotonic() - started < 10
    store.advance(ids[0], "cancelled", owner=OWNER)
    store.redis.delete(store.key(ids[1]))  # expired meanwhile: ended, with no record
    assert store.wait_any(ids, timeout=5) == {ids[0]: store.get(ids[0]), ids[1]: None, ids[2]: store.get(ids[2])}


def test_list_pages_newest_first_filters_and_drops_expired(store):
    store.limits = StoreLimits(100, 100, 600)
    ids = [create(store)["id"] for _ in range(7)]
    store.advance(ids[1], "succeeded", owner=OWNER)
    store.redis.delete(store.key(ids[3]))  # expired
    seen, cursor = [], None
    while True:
        page, cursor = store.list(owner=OWNER, status=None, limit=2, cursor=cursor)
        seen += [job["id"] for job in page]
        if cursor is None:
            break
    assert seen == [ids[n] for n in (6, 5, 4, 2, 1, 0)]
    assert store.redis.zscore(f"rq:jobs:{OWNER}", ids[3]) is None
    done, cursor = store.list(owner=OWNER, status="succeeded", limit=5, cursor=None)
    assert [job["id"] for job in done] == [ids[1]] and cursor is None
    assert store.list(owner=OTHER, status=None, limit=5, cursor=None) == ([], None)


def test_a_page_of_jobs_reads_only_the_summaries_it_returns(store):
    """A job's record holds its result (up to tens of MB): ``GET /v1/jobs?limit=1`` read 50 records
    and took 3 s, then decoded the one it listed (2 s for 16.8 MB). A page reads the summaries it
    returns, never a result; a status filter reads statuses first."""
    store.limits = StoreLimits(100, 100, 600)
    ids = [create(store, metadata={"i": i})["id"] for i in range(60)]
    for job_id in ids[:30:3]:
        store.advance(job_id, "succeeded", owner=OWNER, result={"choices": []})
    # Results no JSON reader takes: a listing that read one would fail.
    for job_id in (ids[59], *ids[:30:3]):
        store.redis.hset(JobStore.key(job_id), "result", b"\xff not json")
    loaded: list[str] = []
    read = store.summaries
    store.summaries = lambda job_ids: loaded.extend(job_ids) or read(job_ids)
    try:
        page, cursor = store.list(owner=OWNER, status=None, limit=1, cursor=None)
        assert [job["id"] for job in page] == [ids[59]] and loaded == [ids[59]] and cursor is not None
        assert "result" not in page[0] and "request" not in page[0]
        assert (page[0]["status"], page[0]["metadata"], page[0]["kind"]) == ("queued", {"i": 59}, "generate")
        loaded.clear()
        done, _ = store.list(owner=OWNER, status="succeeded", limit=4, cursor=None)
        assert [job["id"] for job in done] == [ids[27], ids[24], ids[21], ids[18]]
        assert done[0]["completed_at"] is not None and "result" not in done[0]
        assert set(loaded) <= set(ids[:30:3])
    finally:
        del store.summaries


@pytest.mark.parametrize("timeout", [0.0004, 0.0015, 0.01])
def test_a_wait_shorter_than_a_millisecond_ends_and_does_not_block_for_ever(store, timeout):
    # Redis reads a BLPOP timeout under 1 ms as 0: block for ever. The sync routes wait whatever
    # is left of their deadline, which can be that short.
    job = store.create(owner=OWNER, kind="generate", request={"token_ids": [1]}, request_id=None)
    answers: list = []
    waiter = threading.Thread(target=lambda: answers.append(store.wait(job["id"], timeout=timeout)), daemon=True)
    waiter.start()
    waiter.join(5)
    assert answers == [None]
