"""What a route's argument schema costs when it is built per request (issue #29, the API's CPU per job).

webargs, given a schema class, builds an instance on every request (``web/blueprint.py``). Side by
side in one process: webargs parsing a ``POST /v1/jobs`` body with a new ``SubmitJobSchema`` per
call (what a class gives) and with one instance (what every route now has), alternated, the best
of three rounds each; beside them the whole ``POST /v1/jobs`` through Flask's test client (no
workers), so the saving reads as a share of the request.

Run: ``python -m bench.argument_schemas`` from the repository root.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.rows import print_rows  # noqa: E402

KEY = "bench-key"
CALLS = 2000
BODY = {"token_ids": list(range(100, 132)), "sampling_params": {"max_tokens": 32, "temperature": 0}}


def run(calls: int = CALLS, rounds: int = 3) -> list[dict]:
    from domain.infra.redis_server import EmbeddedRedis
    from domain.settings import Settings
    from engine.demo_model import build_demo_model
    from web.api.schemas import SubmitJobSchema
    from web.app import create_app
    from web.blueprint import Blueprint

    parser = Blueprint.ARGUMENTS_PARSER
    shared = SubmitJobSchema()
    best = {"class": float("inf"), "instance": float("inf"), "request": float("inf")}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        redis_server = EmbeddedRedis(state / "redis", persistent=False).start()
        try:
            settings = Settings(state_dir=state, model=str(build_demo_model(state / "model")), api_keys=(KEY,),
                                max_queued_per_key=10**7, max_queued_total=10**7)
            app = create_app(settings, redis_server.url)
            client = app.test_client()
            headers = {"Authorization": f"Bearer {KEY}"}
            with app.test_request_context("/v1/jobs", method="POST", json=BODY):
                for _ in range(rounds):
                    for name, argmap in (("class", SubmitJobSchema), ("instance", shared)):
                        started = time.perf_counter()
                        for _ in range(calls):
                            parser.parse(argmap, location="json")
                        best[name] = min(best[name], (time.perf_counter() - started) / calls)
            for _ in range(rounds):
                started = time.perf_counter()
                for _ in range(calls // 4):
                    assert client.post("/v1/jobs", json=BODY, headers=headers).status_code == 202
                best["request"] = min(best["request"], (time.perf_counter() - started) / (calls // 4))
        finally:
            redis_server.stop()
    saved = best["class"] - best["instance"]
    return [
        {"name": "argument parsing of a POST /v1/jobs body, one schema instance / a new one per request",
         "value": round(best["instance"] / best["class"], 3), "goal": None},
        {"name": f"· per request: new schema {best['class'] * 1e6:.0f} µs, one instance {best['instance'] * 1e6:.0f} µs; "
                 f"the whole POST /v1/jobs {best['request'] * 1e6:.0f} µs (the saving: "
                 f"{saved / (best['request'] + saved):.0%} of it)", "value": round(saved * 1e6), "goal": None},
    ]


if __name__ == "__main__":
    print_rows(run())
