"""Streams across faults: a kill -9 of the GPU worker mid-job (the job is redone from its prompt,
attempt 2; the native events say ``restart`` and the client drops the void attempt; a dialect
stream continues where the redo provably equals what it sent), and a Redis blip under open streams
(ridden out, then on from where they were). Either way the streamed tokens equal the final
result's, in order, none twice."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
from rollout_queue_client import RolloutClient

from domain.infra.redis_server import EmbeddedRedis, free_port
from domain.names import SHARED_GENERATE_QUEUE
from tests.e2e.conftest import API_KEY, build_stack, log_dir_for, make_stack_env
from tests.e2e.dialect_server import serve

# A 900-token row, a 1 s Redis outage and the reconnects after it took more than 6 s of a job's
# time with the suite's other files running beside it (pytest -n): time limits are not what these
# tests check, so they leave room. A killed GPU worker's message comes back through its expired
# heartbeat (workers/held_messages.py), not the visibility timeout.
VISIBILITY_S, HARD_LIMIT_S, SOFT_LIMIT_S = 40, 35, 30


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("stream-fault-redis"), port=free_port(), persistent=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def killable(redis_server, demo_model_dir, loopback_host, tmp_path_factory):
    server = redis_server  # the module's: the blip tests stop and start it
    env = make_stack_env(redis_url=server.url, model_dir=demo_model_dir, loopback=loopback_host,
                         state_dir=tmp_path_factory.mktemp("stream-fault-state"), node_id="stream-faults",
                         ROLLOUT_VISIBILITY_TIMEOUT=str(VISIBILITY_S), ROLLOUT_TASK_TIME_LIMIT=str(HARD_LIMIT_S),
                         ROLLOUT_TASK_SOFT_TIME_LIMIT=str(SOFT_LIMIT_S))
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "stream-faults"), workers=("gpu",)) as stack:
        yield stack


class OpenStreams:
    """An SGLang stream of ``body`` and, once its first chunk names the job, the native stream of
    that job through the bundled client, each read on its own thread."""

    def __init__(self, url: str, body: dict):
        self.url, self.body = url, body
        self.chunks: list[dict] = []
        self.native: dict = {}
        self._dialect = threading.Thread(target=self._read_dialect)
        self._follower: threading.Thread | None = None

    def start(self) -> str:
        self._dialect.start()
        deadline = time.monotonic() + 60
        while not self.chunks and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.chunks, "no first chunk"
        job_id = self.chunks[0]["meta_info"]["job_id"]
        self._follower = threading.Thread(target=self._read_native, args=(job_id,))
        self._follower.start()
        return job_id

    def join(self) -> None:
        self._dialect.join(120)
        self._follower.join(120)

    def _read_dialect(self) -> None:
        with requests.post(f"{self.url}/generate", headers={"Authorization": f"Bearer {API_KEY}"}, json=self.body,
                           stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data:") and line != b"data: [DONE]":
                    self.chunks.append(json.loads(line[5:]))

    def _read_native(self, job_id: str) -> None:
        with RolloutClient(self.url, API_KEY) as client:
            stream = client.stream(job_id)
            self.native["events"] = [event["event"] for event in stream]
            self.native["token_ids"] = stream.token_ids[0]


def test_streams_survive_a_gpu_worker_killed_mid_job(killable):
    stack = killable
    body = {"input_ids": [120, 140, 150], "stream": True,
            "sampling_params": {"max_new_tokens": 700, "temperature": 0, "ignore_eos": True}}
    with serve(stack, stream_keepalive_seconds=0.2) as (url, _):
        streams = OpenStreams(url, body)
        job_id = streams.start()
        chunks, native = streams.chunks, streams.native
        assert stack.services.redis.llen(SHARED_GENERATE_QUEUE) == 0
        stack.kill("gpu")  # kill -9 mid-job: its message is unacknowledged and comes back
        sent_before_kill = len(chunks[-1]["output_ids"])
        stack.start("gpu")
        streams.join()
    job = stack.wait(job_id, timeout=60)
    assert job["status"] == "succeeded", job
    final = job["result"]["choices"][0]["token_ids"]
    assert len(final) == 700 and 0 < sent_before_kill < 700
    events = stack.services.events.all(job_id)
    assert [e.data for e in events if e.type == "restart"] == [{"attempt": 2}]
    # The dialect's chunks are cumulative and never went back: their last is the result.
    ids = [c["output_ids"] for c in chunks]
    assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:], strict=False))
    assert ids[-1] == final and "error" not in chunks[-1]
    # The native stream said restart, and the client's tokens are the result's.
    assert "restart" in native["events"] and native["events"][-1] == "result"
    assert native["token_ids"] == final


def test_streams_ride_out_a_redis_blip(killable, redis_server):
    """A one-second Redis outage ended live streams with ``service_unavailable`` (which reads as a
    failed job); now the native and the SGLang stream wait it out and go on where they were."""
    stack = killable
    body = {"input_ids": [121, 140, 150], "stream": True,
            "sampling_params": {"max_new_tokens": 900, "temperature": 0, "ignore_eos": True}}
    with serve(stack, stream_keepalive_seconds=0.2) as (url, _):
        streams = OpenStreams(url, body)
        job_id = streams.start()
        chunks, native = streams.chunks, streams.native
        time.sleep(0.2)
        redis_server.stop()
        time.sleep(1.0)
        redis_server.start()  # same port, same append-only file
        streams.join()
    job = stack.wait(job_id, timeout=60)
    assert job["status"] == "succeeded", job
    final = job["result"]["choices"][0]["token_ids"]
    assert all("error" not in chunk for chunk in chunks), [c for c in chunks if "error" in c][:1]
    assert chunks[-1]["output_ids"] == final
    assert native["events"][-1] == "result" and "error" not in native["events"]
    assert native["token_ids"] == final


def test_past_the_outage_bound_the_native_stream_says_interrupted_and_the_client_resumes(killable, redis_server):
    stack = killable
    job = stack.submit({"token_ids": [122, 140, 150],
                        "sampling_params": {"max_tokens": 900, "temperature": 0, "ignore_eos": True}})
    with serve(stack, stream_keepalive_seconds=0.2, stream_outage_seconds=0) as (url, _):
        seen: list[str] = []
        native: dict = {}

        def read_native():
            with RolloutClient(url, API_KEY) as client:
                stream = client.stream(job["id"])
                for event in stream:
                    seen.append(event["event"])
                native["token_ids"] = stream.token_ids[0]

        follower = threading.Thread(target=read_native)
        follower.start()
        deadline = time.monotonic() + 60
        while "tokens" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        redis_server.stop()
        time.sleep(1.0)
        redis_server.start()
        follower.join(120)
    done = stack.wait(job["id"], timeout=60)
    assert done["status"] == "succeeded"
    assert seen[-1] == "result" and native["token_ids"] == done["result"]["choices"][0]["token_ids"]
