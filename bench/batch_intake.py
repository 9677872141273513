"""Scoring a batch while its file is read, beside reading it whole first (issue #29, bulk scoring).

``POST /v1/batches`` checks a file a block of lines at a time and stores each block as it comes
(``domain/batches/creation.BatchIntake``): the chunks of plain score lines are queued at once, and
the GPU worker scores them while the API checks the rest. Before, the whole file was checked first
and only then stored and queued, so the GPU worker waited out the intake. Here the earlier way is
the same code handed the whole file as one block.

The same stack as ``bench.service`` (embedded Redis, CPU, GPU and batches workers as subprocesses,
the API in-process through Flask's test client), the same 2,000 score rows (32 + 32 ids) through
one ``POST /v1/batches`` until ``completed``, the two ways alternated round by round; medians, and
the rows already scored when the POST answered.

Run: ``python -m bench.batch_intake [--rounds 10]`` from the repository root (about a minute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from bench.rows import print_rows
from bench.stack import BATCH, HEADERS, NEW_TOKENS, Service, job_body, prompt
from domain.batches.creation import ParsedBatch
from engine.demo_model import build_demo_model
from web.api import batches as batches_route
from web.api.batch_upload import check_lines

ROWS = 2000


@contextmanager
def whole_file_first():
    """The API checks every line of the file before it stores any (the way before BatchIntake)."""

    def whole(data: bytes, **options):
        total, blocks = check_lines(data, **options)
        merged = ParsedBatch(total=total)
        for block in blocks:
            merged.valid += block.valid
            merged.invalid += block.invalid
            merged.scoring += block.scoring
        return total, iter([merged])

    batches_route.check_lines = whole
    try:
        yield
    finally:
        batches_route.check_lines = check_lines


def score_file(rows: int) -> bytes:
    completion = prompt(10_000, NEW_TOKENS)
    return ("\n".join(json.dumps({"custom_id": f"row-{i}", "kind": "score",
                                  "body": {"token_ids": prompt(i), "completion_token_ids": completion}})
                      for i in range(rows)) + "\n").encode()


def one_batch(service: Service, data: bytes) -> tuple[float, float, int]:
    """(seconds until completed, seconds until the POST answered, rows scored by then)."""
    started = time.perf_counter()
    response = service.client.post("/v1/batches", data=data, headers={**HEADERS, "Content-Type": "application/jsonl"})
    assert response.status_code == 202, response.get_json()
    accepted = time.perf_counter() - started
    scored = response.get_json()["request_counts"]["completed"]
    url = f"/v1/batches/{response.get_json()['id']}"
    while (batch := service.client.get(f"{url}?wait=10", headers=HEADERS).get_json())["status"] != "completed":
        assert batch["status"] in ("validating", "in_progress", "finalizing"), batch
    return time.perf_counter() - started, accepted, scored


def run(rows: int = ROWS, rounds: int = 10) -> list[dict]:
    data = score_file(rows)
    results: dict[str, list[tuple[float, float, int]]] = {"stream": [], "whole": []}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        service = Service(state, build_demo_model(state / "model"))
        try:
            service.start_workers()
            service.wait_ready()
            for job_id in [service.submit(job_body(i)) for i in range(BATCH)]:  # the GPU worker warmed up
                service.result(job_id)
            one_batch(service, data)
            for round_ in range(2 * rounds):
                if round_ % 2:
                    with whole_file_first():
                        results["whole"].append(one_batch(service, data))
                else:
                    results["stream"].append(one_batch(service, data))
        finally:
            service.close()
    stream, whole = (statistics.median(t for t, _, _ in results[way]) for way in ("stream", "whole"))
    return [
        {"name": f"bulk scoring {rows} rows, scored while the file is read / read whole first (median s)",
         "value": round(stream / whole, 3), "goal": ""},
        {"name": "· scored while the file is read: POST until completed (median s)", "value": round(stream, 3), "goal": ""},
        {"name": "· the whole file read first: POST until completed (median s)", "value": round(whole, 3), "goal": ""},
        {"name": "· scored while read: the POST's own time (median s)",
         "value": round(statistics.median(a for _, a, _ in results["stream"]), 3), "goal": ""},
        {"name": "· read whole first: the POST's own time (median s)",
         "value": round(statistics.median(a for _, a, _ in results["whole"]), 3), "goal": ""},
        {"name": "· scored while read: rows already scored when the POST answered (median)",
         "value": statistics.median(n for _, _, n in results["stream"]), "goal": ""},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print_rows(run(args.rows, args.rounds))


if __name__ == "__main__":
    main()
