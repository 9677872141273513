"""Streaming through the service: time to first token, what streaming costs, how early tokens come.

A real stack (bench.service.Service: embedded Redis, CPU/GPU/batches worker subprocesses) with the
API as a user runs it (``rollout-queue api``: gunicorn at its defaults, a process of its own) on
loopback HTTP, read by real HTTP clients in this process. The readers used to share the server's
interpreter (werkzeug in this process): 64 reader threads parsing SSE then took the GIL from the
server's own, which no deployment does, and the ratio measured that (0.40 then; 0.68 this way):

- time to first token of one greedy job through ``POST /generate`` with ``stream: true`` (submit
  to first chunk at the client), beside the engine's prefill of the same prompt in-process
  (``Engine.generate`` with ``max_tokens=1``): reported, no goal;
- streamed / non-streamed throughput of the same 64 jobs (32 prompt ids, 32 new tokens): all
  submitted at once and waited for, vs the same with one SSE reader per job on
  ``/v1/jobs/{id}/events``, opened as its job is accepted, until its ``result`` (median of 3
  rounds each; beside it the share of the tokens that came as ``tokens`` events). Goal >= 0.9;
- the first token of a 128-token greedy job at the client, as a share of its total time (submit to
  last chunk). Goal <= 25 %;
- what the GPU session's publishing costs: one ``JobEvents.publish_tokens`` pipeline for a step of
  16 rows against one decode step of 16 rows in-process (reported).

Run: ``python -m bench.streaming`` from the repository root (about a minute on 2 cores).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch

from bench.http_service import start_api
from bench.service import _row
from bench.stack import BATCH, HEADERS, Service, engine_request, job_body
from domain.jobs.events import JobEvents
from engine.demo_model import build_demo_model
from engine.generation import Engine
from engine.loading import load_model


def first_and_total(url: str, body: dict) -> tuple[float, float]:
    """Seconds from the request to its first chunk with tokens, and to its last chunk."""
    started = time.perf_counter()
    first = None
    with requests.post(f"{url}/generate", json={**body, "stream": True}, headers=HEADERS, stream=True,
                       timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter() - started
    return first, time.perf_counter() - started


def sglang_body(i: int, max_tokens: int) -> dict:
    body = job_body(i, max_tokens)
    params = body["sampling_params"]
    return {"input_ids": body["token_ids"], "sampling_params": {"max_new_tokens": params["max_tokens"],
                                                                "temperature": 0, "ignore_eos": True}}


def plain_round(url: str, session: requests.Session, jobs: int, base: int) -> float:
    started = time.perf_counter()
    ids = [session.post(f"{url}/v1/jobs", json=job_body(base + i), headers=HEADERS, timeout=30).json()["id"]
           for i in range(jobs)]
    for job_id in ids:
        while True:
            job = session.get(f"{url}/v1/jobs/{job_id}", headers=HEADERS, timeout=30).json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.01)
    return time.perf_counter() - started


def streamed_round(url: str, session: requests.Session, jobs: int, base: int) -> tuple[float, float]:
    """Seconds until every reader had its result, and the share of the tokens that came as
    ``tokens`` events."""
    started = time.perf_counter()
    tokens, streamed = [], []

    def read(job_id: str) -> None:
        """Tokens as ``tokens`` events, and in all (a reader the GPU worker saw only after the job
        ended gets them in its ``result``, as the Python client completes its stream)."""
        count, event = 0, None
        with requests.get(f"{url}/v1/jobs/{job_id}/events", headers=HEADERS, stream=True, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"event: "):
                    event = line[7:].decode()
                elif line.startswith(b"data: ") and event == "tokens":
                    count += sum(len(c["token_ids"]) for c in json.loads(line[6:])["choices"])
                elif line.startswith(b"data: ") and event == "result":
                    result = json.loads(line[6:])["result"]
                    tokens.append(sum(len(c["token_ids"]) for c in result["choices"]))
        streamed.append(count)

    readers = []
    for i in range(jobs):  # each job's reader starts as soon as the job is accepted, as a streaming client's
        job_id = session.post(f"{url}/v1/jobs", json=job_body(base + i), headers=HEADERS, timeout=30).json()["id"]
        readers.append(threading.Thread(target=read, args=(job_id,)))
        readers[-1].start()
    for reader in readers:
        reader.join()
    assert sum(tokens) == jobs * 32, sum(tokens)
    return time.perf_counter() - started, sum(streamed) / sum(tokens)


def publish_cost(service: Service, engine: Engine) -> tuple[float, float]:
    """Median seconds of one publish pipeline for 16 rows, and of one 16-row decode step in-process."""
    events = JobEvents(service.svc.redis, ttl=600)
    deltas = [(f"job_bench{i}", 1, [{"index": 0, "offset": 0, "token_ids": [123], "text": "ab",
                                     "finish_reason": None}]) for i in range(BATCH)]
    publish = []
    for _ in range(200):
        started = time.perf_counter()
        events.publish_tokens(deltas)
        publish.append(time.perf_counter() - started)
    steps = []
    scheduler = engine.scheduler()
    for i in range(BATCH):
        scheduler.submit(engine_request(i, 64))
    scheduler.step()  # prefill
    for _ in range(30):
        started = time.perf_counter()
        scheduler.step()
        steps.append(time.perf_counter() - started)
    while scheduler.has_work:
        scheduler.step()
    return statistics.median(publish), statistics.median(steps)


def run(jobs: int = 64, rounds: int = 3) -> list[dict]:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="rq-bench-stream-") as tmp:
        state = Path(tmp)
        model_dir = build_demo_model(state / "model")
        service = Service(state, model_dir)
        try:
            service.start_workers()
            engine = Engine(load_model(str(model_dir), device="cpu"))
            service.wait_ready()
            url = start_api(service)
            session = requests.Session()
            plain_round(url, session, BATCH, 10_000)  # warm-up: the first task after a start is slow
            streamed_round(url, session, BATCH, 10_500)
            ttft = statistics.median(first_and_total(url, sglang_body(20_000 + i, 8))[0] for i in range(5))
            engine.generate([engine_request(0, 1)])
            prefill = []
            for i in range(5):
                started = time.perf_counter()
                engine.generate([engine_request(20_000 + i, 1)])
                prefill.append(time.perf_counter() - started)
            plain, streamed, share_streamed = [], [], []
            for r in range(rounds):
                plain.append(plain_round(url, session, jobs, 30_000 + 2 * r * jobs))
                seconds, share = streamed_round(url, session, jobs, 30_000 + (2 * r + 1) * jobs)
                streamed.append(seconds)
                share_streamed.append(share)
            shares = [first / total for first, total in (first_and_total(url, sglang_body(40_000 + i, 128))
                                                         for i in range(3))]
            publish_s, step_s = publish_cost(service, engine)
        finally:
            service.close()  # the API's process too (start_api adds it to the workers)
    plain_s, streamed_s = statistics.median(plain), statistics.median(streamed)
    return [
        _row(f"streamed / non-streamed throughput ({jobs} jobs x 32 tokens, median of {rounds})",
             plain_s / streamed_s, ">= 0.9"),
        _row(f"· non-streamed: {jobs} jobs submitted, polled until all ended (s)", plain_s),
        _row("· streamed: the same with one SSE reader per job until its result (s)", streamed_s),
        _row("· streamed: share of the tokens read as tokens events (the rest came in the result: the "
             "job ended before the GPU worker saw its reader)", statistics.median(share_streamed)),
        _row("first token of a 128-token greedy job / its total time, at the client (median of 3)",
             statistics.median(shares), "<= 0.25"),
        _row("· time to first token through the service, SGLang stream (ms, median of 5)", ttft * 1e3),
        _row("· the engine's prefill of the same prompt in-process (ms, median of 5)",
             statistics.median(prefill) * 1e3),
        _row("· GPU session: one publish pipeline for 16 rows (ms); written per step, or per "
             "ROLLOUT_STREAM_FLUSH_MS (10) when steps are faster", publish_s * 1e3),
        _row("· one 16-row decode step in-process (ms)", step_s * 1e3),
        _row("· publishing / decoding time, GPU session, at 10 ms flushes (ratio)",
             publish_s / max(step_s, 0.010)),
    ]


if __name__ == "__main__":
    for row in run():
        print(f"{row['name']}: {row['value']}" + (f" (goal {row['goal']})" if row["goal"] else ""))
