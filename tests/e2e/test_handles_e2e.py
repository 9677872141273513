"""A job whose feature handles die with their producer is preprocessed again, not failed."""

from __future__ import annotations

import time

import pytest

from domain.jobs.store import JobStore
from tests.conftest import db_url
from tests.e2e.conftest import build_stack, log_dir_for, make_stack_env
from tests.e2e.test_jobs_e2e import GREEDY, image_data_url


@pytest.fixture(scope="module")
def own_stack(redis_url, demo_model_dir, loopback_host, tmp_path_factory):
    env = make_stack_env(redis_url=db_url(redis_url, 6), model_dir=demo_model_dir, loopback=loopback_host,
                         state_dir=tmp_path_factory.mktemp("handles-state"), node_id="handles-node")
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "handles"), workers=("cpu", "gpu")) as stack:
        stack.services.redis.flushdb()
        yield stack


def test_producer_killed_before_the_gpu_opens_its_handles(own_stack):
    stack = own_stack
    body = {"prompt": "<image>Describe.", "content_parts": [{"type": "image_url", "url": image_data_url(96, 64)}],
            "sampling_params": GREEDY}
    reference = stack.wait(stack.submit(body)["id"])
    assert reference["status"] == "succeeded" and reference["result"]["transport"] == "shm"

    reopened_before = int(stack.services.redis.hget("rq:metrics:counters", "handle_unavailable") or 0)
    stack.stop("gpu")
    job = stack.submit(body)
    deadline = time.monotonic() + 60
    # Handed over: its generate message waits in the node's queue (the prompt alone is saved a
    # moment before the message is sent; a kill between the two leaves the message to kombu).
    node_queue = stack.services.settings.generate_queue
    while not (stack.services.redis.exists(JobStore.prompt_key(job["id"]))
               and job["id"].encode() in b"".join(stack.services.redis.lrange(node_queue, 0, -1))):
        assert time.monotonic() < deadline, "the CPU worker never handed the job over"
        time.sleep(0.05)
    stack.kill("cpu")  # the producer dies with the shared memory its handles name
    time.sleep(1.0)  # its resource tracker unlinks the segment
    stack.start("cpu")
    stack.start("gpu")
    stack.wait_ready()

    done = stack.wait(job["id"], timeout=120)
    assert done["status"] == "succeeded", done
    assert done["result"]["choices"][0]["token_ids"] == reference["result"]["choices"][0]["token_ids"]
    assert done["result"]["prompt_token_ids"] == reference["result"]["prompt_token_ids"]
    # It went the way under test: the GPU worker could not open the handles and sent it back.
    assert int(stack.services.redis.hget("rq:metrics:counters", "handle_unavailable") or 0) == reopened_before + 1
