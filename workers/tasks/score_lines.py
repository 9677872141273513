"""Scoring batch lines directly: a chunk of plain-token score lines in one GPU task.

A score line of plain token ids needs no processor, and a job record plus two Celery messages per
line cost the service more than the scoring itself (the bulk-scoring figure of bench/README.md). Such lines
are scored here, ``ROLLOUT_GPU_BATCH_SIZE`` rows per forward pass, and recorded straight into the
batch's results. Other lines (media, generation) still run as jobs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from celery import shared_task

from domain.batches.progress import line_error, record_lines
from domain.batches.store import DIRECT_LINE
from domain.jobs.results import engine_result
from domain.names import SCORE_LINES_TASK
from engine.errors import NotFoundError, RolloutError
from workers.runtime import runtime
from workers.tasks.outage import requeued_while_redis_is_down

log = logging.getLogger(__name__)


def scorable_directly(request: dict[str, Any], model_facts) -> bool:
    """Whether a stored batch line scores without a job: plain token ids, no media."""
    return (isinstance(request, dict) and request.get("kind") == "score" and not request.get("content_parts") and not request.get("features")
            and bool(request.get("token_ids")) and model_facts.is_plain_text(request["token_ids"])
            and model_facts.is_plain_text(request["completion_token_ids"]))


@shared_task(name=SCORE_LINES_TASK, bind=True)
def score_lines(self, batch_id: str, index: int) -> int:
    """Score the direct lines of chunk ``index`` not yet counted; how many were scored."""
    with requeued_while_redis_is_down(f"scoring chunk {index} of batch {batch_id}"):
        return _score_chunk(runtime(self.app), batch_id, index)


def _score_chunk(rt, batch_id: str, index: int) -> int:
    store = rt.batches
    try:
        batch = store.get(batch_id)
    except NotFoundError:
        return 0
    if batch["status"] not in ("validating", "in_progress"):  # validating: scored while its file is read
        store.scoring_done(batch_id, index, [])
        return 0  # cancelled or expired: the sweep counts these lines
    # orjson: a fifth of the stdlib's time for a stored score line. It reads an integer past 64 bits
    # as a float, so it is used only here, where nothing but the line number, custom_id and the two
    # validated id lists is read: a metadata value it might read inexactly never leaves this task.
    lines = [orjson.loads(text) for text in store.chunk_text(batch_id, index, batch["chunk_size"])]
    numbers = [line["line"] for line in lines]
    mine = store.line_jobs(batch_id, numbers)
    ended = store.ended(batch_id, numbers)
    pending = [line for line in lines if mine.get(line["line"]) == DIRECT_LINE and line["line"] not in ended]
    engine = rt.wait_for_model()
    size = rt.settings.batch_rows
    for start in range(0, len(pending), size):
        record_lines(rt, batch_id, _score(engine, pending[start:start + size]))
    if not store.scoring_done(batch_id, index, [number for number in numbers if mine.get(number) == DIRECT_LINE]):
        log.warning("batch %s chunk %d: its scored lines are not on the primary (a failover took them); "
                    "the batch reaper runs it again", batch_id, index)
    return len(pending)


def _score(engine, lines: list[dict]) -> list[tuple[int, bool, dict]]:
    from engine.scoring import ScoreRequest

    # Only the two id lists are read (scorable_directly checked them): a whole JobRequest per line,
    # sampling parameters and all, cost ~4 % of the GPU worker's scoring time (py-spy, bench.service).
    requests = [ScoreRequest(prompt_token_ids=line["request"]["token_ids"],
                             completion_token_ids=line["request"]["completion_token_ids"]) for line in lines]
    started = time.perf_counter()
    try:
        results = engine.score(requests)
    except Exception as error:
        if len(lines) > 1:
            # One bad row must not fail its batch mates, whatever it raised: score each half.
            half = len(lines) // 2
            return [entry for part in (lines[:half], lines[half:]) for entry in _score(engine, part)]
        if isinstance(error, RolloutError):
            return [line_error(lines[0], error.code, error.message)]
        log.exception("batch line %s: unexpected error while scoring", lines[0]["line"])
        return [line_error(lines[0], "internal_error", "internal error while scoring")]
    elapsed = time.perf_counter() - started
    entries = []
    for line, result in zip(lines, results, strict=True):
        body = engine_result(result, kind="score", prompt_token_ids=result.prompt_token_ids, placeholder_ranges=[],
                             weight_version=result.weight_version, transport="inline",
                             timings={**result.timings, "score": elapsed, "batch_size": len(lines)})
        entries.append((line["line"], True, {"custom_id": line["custom_id"], "line": line["line"],
                                             "response": {"status_code": 200, "body": body}}))
    return entries
