"""Batch intake: how long the API takes to accept a 10,000-line JSONL file (goal: under 5 s).

Measured over real HTTP: the API (werkzeug, threaded, in this process) on an isolated Redis, the
Python client uploading the file. "Accept" is everything ``POST /v1/batches`` does before it
answers 202: read the body, validate every line (marshmallow, the job schema and limits), store the
valid lines in Redis and queue one Celery message per chunk. Then, separately, the time the chunk
task's body takes to create every job and queue its preprocessing (what the ``batches`` worker
does afterwards, in the background), run here in-process.

``--format openai`` sends the same rows in the OpenAI Batch format the way the official client
does: upload to ``/v1/files``, then ``POST /v1/batches`` naming the file; "accept" is both calls.
``chat`` lines (``/v1/chat/completions``, a message of about ``tokens`` words, mapped through the
chat template and tokenizer like the synchronous route) or ``jobs`` lines (``/v1/jobs``: the rows
above as our own requests, a quarter scoring lines).

``--overlap`` compares, in this process, checking a chat file with its tokenizer calls in a thread
beside the Python steps (what ``web.api.batch_upload`` does) against the same steps with each chunk's
call in line, alternated three times each; the ratio of the best times is the row.

Run: ``python -m bench.batch_submit [--lines 10000] [--tokens 50 200] [--format native openai]
[--overlap]`` from the repository root.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import requests  # noqa: E402
from rollout_queue_client import RolloutClient  # noqa: E402
from werkzeug.serving import make_server  # noqa: E402

from domain.infra.redis_server import EmbeddedRedis  # noqa: E402
from domain.settings import Settings  # noqa: E402
from engine.demo_model import build_demo_model  # noqa: E402
from web.api import batch_upload, batches  # noqa: E402
from web.app import create_app  # noqa: E402
from workers.tasks.batches import submit_chunk  # noqa: E402

GOAL_SECONDS = 5.0
KEY = "bench-key"


def make_file(lines: int, tokens: int) -> bytes:
    rows = []
    for n in range(lines):
        body = {"token_ids": [(n + i) % 600 + 1 for i in range(tokens)],  # within the demo vocabulary (640)
                "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": n}}
        kind = "generate"
        if n % 4 == 3:  # a quarter are scoring lines
            kind, body = "score", {"token_ids": body["token_ids"], "completion_token_ids": [5, 6, 7, 8]}
        rows.append(json.dumps({"custom_id": f"row-{n}", "kind": kind, "body": body}))
    return ("\n".join(rows) + "\n").encode()


def make_openai_file(lines: int, tokens: int, url: str, model: str) -> bytes:
    rows = []
    for n in range(lines):
        if url == "/v1/chat/completions":
            text = " ".join(f"w{(n + i) % 97}" for i in range(tokens))
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16,
                    "temperature": 1.0, "seed": n}
        else:
            token_ids = [(n + i) % 600 + 1 for i in range(tokens)]  # the rows of the native file
            body = {"kind": "generate", "token_ids": token_ids,
                    "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": n}}
            if n % 4 == 3:
                body = {"kind": "score", "token_ids": token_ids, "completion_token_ids": [5, 6, 7, 8]}
        rows.append(json.dumps({"custom_id": f"row-{n}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(rows) + "\n").encode()


def submit_openai(http, data: bytes, url: str) -> dict:
    """What ``openai.files.create`` then ``openai.batches.create`` send."""
    uploaded = http.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    made = http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"], "endpoint": url,
                                          "completion_window": "24h"})
    assert made.status_code == 202, made.text
    return made.json()


def run(lines: int, token_counts: list[int], create_jobs: bool, formats: tuple[str, ...] = ("native",)) -> list[tuple]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        redis_server = EmbeddedRedis(state / "redis", persistent=False).start()
        try:
            settings = Settings(state_dir=state, model=str(build_demo_model(state / "model")), api_keys=(KEY,),
                                max_body_bytes=512 * 1024 * 1024, max_queued_per_key=10**7, max_queued_total=10**7)
            app = create_app(settings, redis_server.url)
            if "batches" not in app.blueprints:
                app.extensions["flask-smorest"]["apis"][""]["ext_obj"].register_blueprint(batches.blp)
            server = make_server("127.0.0.1", 0, app, threaded=True)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            client = RolloutClient(f"http://127.0.0.1:{server.server_port}", api_key=KEY, timeout=120)
            client.batch_submit(make_file(10, 8))  # warm-up: first-request costs are not the figure
            http = requests.Session()
            http.headers["Authorization"] = f"Bearer {KEY}"
            base = f"http://127.0.0.1:{server.server_port}"
            model = requests.get(f"{base}/v1/models", headers=http.headers).json()["data"][0]["id"]
            cases = [("native", None)] * ("native" in formats) + [
                ("openai", url) for url in ("/v1/chat/completions", "/v1/jobs") if "openai" in formats]
            for (kind, url), tokens in itertools.product(cases, token_counts):
                if kind == "native":
                    data = make_file(lines, tokens)
                    started = time.perf_counter()
                    batch = client.batch_submit(data)
                    invalid = batch["errors"]["invalid_lines"]
                else:
                    data = make_openai_file(lines, tokens, url, model)
                    submit_openai(_Based(http, base), make_openai_file(10, 8, url, model), url)  # warm-up
                    started = time.perf_counter()
                    batch = submit_openai(_Based(http, base), data, url)
                    invalid = len((batch["errors"] or {}).get("data") or [])
                accepted = time.perf_counter() - started
                assert batch["request_counts"]["total"] == lines and invalid == 0, batch
                created = None
                if create_jobs:
                    svc = app.extensions["rollout"]
                    chunks = svc.batches.get(batch["id"])["chunks"]
                    started = time.perf_counter()
                    for index in range(chunks):
                        submit_chunk(svc, batch["id"], index)
                    created = time.perf_counter() - started
                    # Every line (numbered from 1) has its job, or is marked for the GPU's direct
                    # scoring, which makes none.
                    assert len(svc.batches.line_jobs(batch["id"], list(range(1, lines + 1)))) == lines
                rows.append((kind if url is None else f"openai {url}", lines, tokens, len(data) / 2**20,
                             accepted, created))
            server.shutdown()
        finally:
            redis_server.stop()
    return rows


def overlap(lines: int, tokens: int, rounds: int = 3) -> tuple[float, float]:
    """Best seconds to check ``lines`` chat lines with the tokenizer overlapped, and in line."""
    from concurrent.futures import Future

    from web.dialects.common import served_model_name, tokenizer
    from web.dialects.openai.batch_lines import CHAT_URL, chat_token_ids

    def in_line(numbered, endpoint):  # web.api.batch_upload._read_lines without the thread
        for start in range(0, len(numbered), batch_upload.LINES_PER_CHUNK):
            chunk = [batch_upload._begin(number, raw, endpoint)
                     for number, raw in numbered[start:start + batch_upload.LINES_PER_CHUNK]]
            pending = [line for line in chunk if line.pending is not None]
            done = Future()
            done.set_result(chat_token_ids([line.pending for line in pending], tokenizer()))
            yield batch_upload._finish(chunk, pending, done)

    overlapped = batch_upload._read_lines
    best = {overlapped: float("inf"), in_line: float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        redis_server = EmbeddedRedis(state / "redis", persistent=False).start()
        try:
            app = create_app(Settings(state_dir=state, model=str(build_demo_model(state / "model")), api_keys=(KEY,)),
                             redis_server.url)
            with app.test_request_context("/"):
                data = make_openai_file(lines, tokens, CHAT_URL, served_model_name())
                batch_upload.validate_lines(data[:10_000].rsplit(b"\n", 1)[0], max_lines=lines)  # warm-up
                for _ in range(rounds):
                    for read in best:
                        batch_upload._read_lines = read
                        started = time.perf_counter()
                        parsed = batch_upload.validate_lines(data, max_lines=lines)
                        best[read] = min(best[read], time.perf_counter() - started)
                        assert len(parsed.valid) == lines, parsed.invalid[:3]
        finally:
            batch_upload._read_lines = overlapped
            redis_server.stop()
    return best[overlapped], best[in_line]


class _Based:
    """A session with the service's base URL (the bench's stand-in for the openai client)."""

    def __init__(self, session: requests.Session, base: str):
        self.session, self.base = session, base

    def post(self, path: str, **kwargs) -> requests.Response:
        return self.session.post(self.base + path, timeout=120, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, nargs="+", default=[50, 200], help="prompt token ids per line")
    parser.add_argument("--no-jobs", action="store_true", help="skip timing the job creation")
    parser.add_argument("--format", nargs="+", choices=["native", "openai"], default=["native", "openai"])
    parser.add_argument("--overlap", action="store_true",
                        help="only compare chat lines' tokenizer calls overlapped / in line, in-process")
    args = parser.parse_args(argv)
    if args.overlap:
        for tokens in args.tokens:
            overlapped, in_line = overlap(args.lines, tokens)
            print(f"{args.lines} chat lines of {tokens} words, checked: tokenizer overlapped {overlapped:.2f} s, "
                  f"in line {in_line:.2f} s, ratio {overlapped / in_line:.2f}")
        return 0
    rows = run(args.lines, args.tokens, not args.no_jobs, tuple(args.format))
    print(f"{'file':<28} {'lines':>7} {'tokens/line':>11} {'MiB':>6} {'accept s':>9} {'lines/s':>8} {'goal':>6} "
          f"{'jobs created s':>15} {'jobs/s':>7}")
    ok = True
    for kind, lines, tokens, mib, accepted, created in rows:
        met = accepted < GOAL_SECONDS
        ok &= met
        jobs = f"{created:15.2f} {lines / created:7.0f}" if created else f"{'-':>15} {'-':>7}"
        print(f"{kind:<28} {lines:>7} {tokens:>11} {mib:6.1f} {accepted:9.2f} {lines / accepted:8.0f} "
              f"{'met' if met else 'MISSED':>6} {jobs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
