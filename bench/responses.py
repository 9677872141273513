"""What the API spends answering for jobs a trainer follows: a step's lookup and a poll.

One app (``create_app``, the Flask test client, as ``bench.service`` runs the API) on an embedded
Redis, 64 jobs ended with a result shaped as the GPU worker writes one (32 prompt ids, 32 tokens with
their logprobs, the timings). Reported, each side by side in one run:

- the CPU per request of ``POST /v1/jobs/lookup`` (64 ended jobs) and ``GET /v1/jobs/{id}``, the
  responses written by the app's JSON provider (orjson, ``web/serving/json_body.py``) against Flask's own
  provider (rounds alternated, medians), and the dump of the lookup's jobs with ``NumberList``
  against marshmallow's own ``fields.List`` (``web/api/schemas.py``), and the parse of a bulk submit's
  body with its depth read from the text against the walk over the value it ran before, and the
  decoding of a job's record with its result read by orjson against ``json``, the same way;
- following a step's 64 jobs while they end in four groups of 16 (a GPU worker's batches), as the
  lookup with ``wait`` does (``JobStore.wait_any`` over the running ones until none is left), against
  waiting for each job in turn as it did before (``JobStore.wait`` per job, then every job read
  again): the follower's CPU, how long after the last end it knew, and the Redis commands (a
  script's own calls counted). Both at the store, so the response's cost is not in the figure.

Run: ``python -m bench.responses`` from the repository root (about 10 s).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import redis
from flask.json.provider import DefaultJSONProvider
from marshmallow import fields

from bench.rows import print_rows
from domain.infra.redis_records import decode_record
from domain.infra.redis_server import EmbeddedRedis
from domain.jobs.store import _JSON_FIELDS, _OWN_JSON_FIELDS, TERMINAL
from domain.jobs.view import public_job
from domain.lifecycle import end_jobs
from domain.settings import Settings
from web.api.schemas import JobLookupResultSchema, NumberList
from web.app import create_app
from web.serving.json_body import JsonProvider, _finite_float, _refuse_constant, _walk, parse_json

KEY = "bench-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
JOBS = 64
GROUP = 16  # jobs that end together (ROLLOUT_GPU_BATCH_SIZE's default)


def result(i: int) -> dict:
    tokens = [100 + (i * 7 + k) % 500 for k in range(32)]
    return {"prompt_token_ids": [100 + (i + k) % 500 for k in range(32)], "placeholder_ranges": [],
            "weight_version": "53be6cda0767685f", "transport": "inline",
            "timings": {"preprocess": 0.0, "prefill_s": 0.0131, "decode_s": 0.0997, "queue_s": 0.105,
                        "generate": 0.1152, "batch_size": 16},
            "nodes": {"preprocess": "", "generate": "bench-node"},
            "choices": [{"index": 0, "token_ids": tokens, "logprobs": [-5.9 - k / 997 for k in range(32)],
                         "finish_reason": "length", "matched_stop": None, "text": None}],
            "usage": {"prompt_tokens": 32, "completion_tokens": 32}}


def run(rounds: int = 40) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedRedis(Path(tmp) / "redis", persistent=False).start()
        try:
            app = create_app(Settings(redis_url=server.url, state_dir=Path(tmp), api_keys=(KEY,),
                                      log_level="WARNING"), server.url)
            client, svc = app.test_client(), app.extensions["rollout"]
            ids = ended_jobs(client, svc)
            cpu = response_cpu(client, ids, rounds)
            dump = dump_cpu(svc, ids, rounds)
            parse = parse_cpu(rounds)
            read = read_cpu(svc, ids, rounds)
            follow = following(client, svc, redis.Redis.from_url(server.url))
        finally:
            server.stop()
    return [
        {"name": f"lookup of {JOBS} ended jobs, API CPU per request: orjson responses / Flask's",
         "value": round(cpu["lookup"]["orjson"] / cpu["lookup"]["flask"], 3), "goal": None},
        {"name": f"· per lookup: Flask's {cpu['lookup']['flask'] * 1e3:.2f} ms, orjson "
                 f"{cpu['lookup']['orjson'] * 1e3:.2f} ms", "value": round(cpu["lookup"]["orjson"] * 1e3, 2),
         "goal": None},
        {"name": f"dumping a lookup's {JOBS} jobs (JobLookupResultSchema): NumberList / marshmallow's List",
         "value": round(dump["NumberList"] / dump["List"], 3), "goal": None},
        {"name": f"· per lookup: marshmallow's List {dump['List'] * 1e3:.2f} ms, NumberList "
                 f"{dump['NumberList'] * 1e3:.2f} ms", "value": round(dump["NumberList"] * 1e3, 2), "goal": None},
        {"name": f"parsing a bulk submit's body of {JOBS} jobs: depth read from the text / walking the value",
         "value": round(parse["text"] / parse["walk"], 3), "goal": None},
        {"name": f"· per body: walking {parse['walk'] * 1e3:.3f} ms, from the text {parse['text'] * 1e3:.3f} ms, "
                 f"json.loads alone {parse['json'] * 1e3:.3f} ms", "value": round(parse["text"] * 1e3, 3), "goal": None},
        {"name": "reading an ended job's record (decode_record): result and timings by orjson / all by json",
         "value": round(read["orjson"] / read["json"], 3), "goal": None},
        {"name": f"· per record: json {read['json'] * 1e6:.1f} µs, result and timings by orjson "
                 f"{read['orjson'] * 1e6:.1f} µs", "value": round(read["orjson"] * 1e6, 1), "goal": None},
        {"name": "GET /v1/jobs/{id} of an ended job, API CPU per request: orjson responses / Flask's",
         "value": round(cpu["get"]["orjson"] / cpu["get"]["flask"], 3), "goal": None},
        {"name": f"following {JOBS} jobs that end in groups of {GROUP}, the follower's CPU: one wait for all / "
                 f"a wait per job", "value": round(follow["one wait for all"]["cpu"] / follow["a wait per job"]["cpu"], 3),
         "goal": None},
        *({"name": f"· {way}: {figures['cpu'] * 1e3:.2f} ms of CPU, answered {figures['tail'] * 1e3:.2f} ms after "
                   f"the last end, {figures['commands']:.0f} Redis commands", "value": round(figures["cpu"] * 1e3, 2),
           "goal": None} for way, figures in follow.items()),
    ]


def ended_jobs(client, svc) -> list[str]:
    ids = [job["id"] for job in client.post("/v1/jobs/bulk", headers=HEADERS, json={"jobs": [
        {"token_ids": [100 + i] * 32, "sampling_params": {"max_tokens": 32}} for i in range(JOBS)]}).get_json()["data"]]
    end_all(svc, ids)
    return ids


def end_all(svc, ids: list[str]) -> None:
    end_jobs(svc, [(job, "succeeded", {"result": result(i)}) for i, job in enumerate(svc.jobs.get_many(ids))])


def response_cpu(client, ids: list[str], rounds: int) -> dict[str, dict[str, float]]:
    calls = {"lookup": lambda: client.post("/v1/jobs/lookup", json={"ids": ids}, headers=HEADERS),
             "get": lambda: client.get(f"/v1/jobs/{ids[0]}", headers=HEADERS)}
    writers = {"orjson": JsonProvider.response, "flask": DefaultJSONProvider.response}
    spent: dict[str, dict[str, list[float]]] = {call: {name: [] for name in writers} for call in calls}
    try:
        for call_name, call in calls.items():
            for r in range(rounds):
                for name in (tuple(writers) if r % 2 else tuple(reversed(writers))):
                    JsonProvider.response = writers[name]
                    started = time.process_time()
                    for _ in range(5):
                        assert call().status_code == 200
                    spent[call_name][name].append((time.process_time() - started) / 5)
    finally:
        JsonProvider.response = writers["orjson"]
    return {call: {name: statistics.median(values) for name, values in by_writer.items()}
            for call, by_writer in spent.items()}


def dump_cpu(svc, ids: list[str], rounds: int) -> dict[str, float]:
    """CPU per dump of a lookup's jobs, the number lists written by NumberList or by fields.List's own
    per-item path (alternated, medians)."""
    body = {"data": [public_job(job) for job in svc.jobs.get_many(ids)], "missing": []}
    schema, ours = JobLookupResultSchema(), NumberList._serialize
    spent: dict[str, list[float]] = {"NumberList": [], "List": []}
    try:
        for r in range(rounds):
            for name in (("NumberList", "List") if r % 2 else ("List", "NumberList")):
                NumberList._serialize = ours if name == "NumberList" else fields.List._serialize
                started = time.process_time()
                for _ in range(5):
                    schema.dump(body)
                spent[name].append((time.process_time() - started) / 5)
    finally:
        NumberList._serialize = ours
    return {name: statistics.median(values) for name, values in spent.items()}


def parse_cpu(rounds: int) -> dict[str, float]:
    """CPU to parse a bulk submit's body: ``parse_json`` (its depth read from the text) against the
    same parse followed by the walk over every item it ran before, and ``json.loads`` alone."""
    text = json.dumps({"jobs": [{"token_ids": [100 + (i * 37 + k * 11) % 500 for k in range(32)],
                                 "sampling_params": {"max_tokens": 32, "temperature": 0.7}} for i in range(JOBS)]})
    def walked():  # parse_json until this module: the same parse, then the walk (more brackets than the depth)
        _walk(json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float), check_strings=False)

    ways = {"text": lambda: parse_json(text), "walk": walked,
            "json": lambda: json.loads(text)}
    spent: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in (tuple(ways) if r % 2 else tuple(reversed(ways))):
            started = time.process_time()
            for _ in range(20):
                ways[name]()
            spent[name].append((time.process_time() - started) / 20)
    return {name: statistics.median(values) for name, values in spent.items()}


def read_cpu(svc, ids: list[str], rounds: int) -> dict[str, float]:
    """CPU to decode one ended job's record as read from Redis, its result and timings by orjson
    (``JobStore``'s ``own_json_fields``) against every JSON field by ``json``, alternated, medians."""
    raws = [svc.redis.hgetall(svc.jobs.key(job_id)) for job_id in ids]
    ways = {"orjson": _OWN_JSON_FIELDS, "json": ()}
    spent: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name in (tuple(ways) if r % 2 else tuple(reversed(ways))):
            started = time.process_time()
            for raw in raws:
                decode_record(raw, json_fields=_JSON_FIELDS, own_json_fields=ways[name])
            spent[name].append((time.process_time() - started) / len(raws))
    return {name: statistics.median(values) for name, values in spent.items()}


def following(client, svc, counter: redis.Redis, rounds: int = 5) -> dict[str, dict[str, float]]:
    """Following a step's jobs while they end in groups, each way (alternated, medians): the
    follower's CPU (its thread's), the time from the last group's end to the answer, and the Redis
    commands (less what ending the jobs costs, counted with no one following)."""
    def per_job(ids: list[str]) -> None:  # the lookup's wait until now: each running job in turn
        for job in svc.jobs.get_many(ids):
            if job["status"] not in TERMINAL:
                svc.jobs.wait(job["id"], timeout=30)
        svc.jobs.get_many(ids)

    def one_wait(ids: list[str]) -> None:
        svc.jobs.owned(ids, KEY)
        running = list(ids)
        while running:
            ended = svc.jobs.wait_any(running, timeout=30)
            running = [job_id for job_id in running if job_id not in ended]

    def follow_once(follow) -> tuple[float, float, int]:
        ids = [job["id"] for job in client.post("/v1/jobs/bulk", headers=HEADERS, json={"jobs": [
            {"token_ids": [100 + i] * 32} for i in range(JOBS)]}).get_json()["data"]]
        ender = Ender(svc, ids)
        before = counter.info("stats")["total_commands_processed"]
        ender.start()
        cpu = time.thread_time()
        if follow is not None:
            follow(ids)
        cpu, answered = time.thread_time() - cpu, time.perf_counter()
        ender.join()
        return cpu, answered - ender.last_end, counter.info("stats")["total_commands_processed"] - before

    ways = {"a wait per job": per_job, "one wait for all": one_wait}
    seen: dict[str, list[tuple[float, float, int]]] = {way: [] for way in ways}
    for r in range(rounds):
        ending = follow_once(None)[2]
        for way in (tuple(ways) if r % 2 else tuple(reversed(ways))):
            cpu, tail, commands = follow_once(ways[way])
            seen[way].append((cpu, tail, commands - ending))
    return {way: {"cpu": statistics.median(v[0] for v in values), "tail": statistics.median(v[1] for v in values),
                  "commands": statistics.median(v[2] for v in values)} for way, values in seen.items()}


class Ender(threading.Thread):
    """Ends the jobs in groups of GROUP, 20 ms apart, as a GPU worker's batches end."""

    def __init__(self, svc, ids: list[str]):
        super().__init__()
        self.svc, self.ids, self.last_end = svc, ids, 0.0

    def run(self) -> None:
        for start in range(0, len(self.ids), GROUP):
            time.sleep(0.02)
            end_all(self.svc, self.ids[start:start + GROUP])
            self.last_end = time.perf_counter()


if __name__ == "__main__":
    print_rows(run())
