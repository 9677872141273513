"""The one typed read of a stored job (domain.jobs.stored_job): what every worker runs from."""

from __future__ import annotations

import pytest

from domain.jobs.stored_job import StoredJob
from engine.errors import InvalidRequestError
from tests.workers.bad_rows import stored_request

OWNER = "owner-a"


def test_a_stored_job_reads_back_typed_with_its_request_owner_and_scope(jobs):
    request = stored_request(token_ids=[5, 6], sampling_params={"top_k": -1}, cache_salt="s1")
    created = jobs.create(owner=OWNER, kind="generate", request=request, request_id=None)
    job = jobs.read_job(created["id"])
    assert (job.id, job.owner, job.kind, job.status) == (created["id"], OWNER, "generate", "queued")
    assert job.created_at == created["created_at"]
    assert job.request.token_ids == [5, 6] and job.request.sampling.top_k == 0  # API meaning mapped once
    assert job.cache_scope == job.request.cache_scope(OWNER) == f"{OWNER}\x1fsalt:s1"
    assert job.record == jobs.get(created["id"])  # the same record every other read decodes


def test_a_job_gone_or_never_made_reads_as_none(jobs):
    assert jobs.read_job("job_missing") is None
    assert jobs.read_job("not an id") is None


def test_a_request_the_engine_refuses_raises_where_it_is_used_not_where_it_is_read(jobs):
    bad = stored_request(token_ids=[1], sampling_params={"max_tokens": 2, "min_tokens": 3})
    job = StoredJob.of(jobs.create(owner=OWNER, kind="generate", request=bad, request_id=None))
    assert job.owner == OWNER  # read: the caller can still fail this job by its id and owner
    with pytest.raises(InvalidRequestError):
        _ = job.request


def test_a_stored_job_names_its_adapter_and_takes_the_attempt_begun_for_it(jobs):
    from domain.jobs.events import Attempt

    tuned = stored_request(token_ids=[1, 2], adapter="tuned", lora_id="k/tuned@4")
    unresolved = stored_request(token_ids=[1, 2], adapter="tuned")
    base = stored_request(token_ids=[1, 2])
    read = [StoredJob.of(jobs.create(owner=OWNER, kind="generate", request=r, request_id=None))
            for r in (tuned, unresolved, base)]
    assert [job.adapter_id for job in read] == ["k/tuned@4", "tuned", ""]
    assert read[0].attempt is None  # not begun on a GPU worker yet
    begun = read[0].began(Attempt(2, watched=True))
    assert begun.attempt == Attempt(2, watched=True) and begun.id == read[0].id and begun.record is read[0].record
