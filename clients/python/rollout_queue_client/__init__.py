"""Python client for Rollout Queue. Needs only ``requests`` and the standard library.

    from rollout_queue_client import RolloutClient

    with RolloutClient("http://127.0.0.1:8000", api_key="...") as rq:
        out = rq.generate({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8}})
        for event in (stream := rq.stream({"token_ids": [1, 2, 3]})):
            print(event["event"], event["data"])   # status, tokens, ..., result; stream.token_ids[0]
        batch = rq.batch_submit("rollouts.jsonl")
        rq.batch_wait(batch["id"], progress=print)
        rq.batch_download(batch["id"], "output.jsonl", "errors.jsonl")

Errors (see ``rollout_queue_client.errors``): ``ClientError`` (``code``, ``message``, ``status``), with
``ConnectionFailedError`` and ``WaitTimeoutError`` under it. 429 and 503 answers are retried with
exponential backoff that honours ``Retry-After`` (``RetryPolicy``); a submit carries an
``Idempotency-Key`` of its own, so it is also sent again after a connection error or a timeout.
"""

from .client import BATCH_DONE, JOB_DONE, RolloutClient
from .errors import ClientError, ConnectionFailedError, WaitTimeoutError
from .retry import RetryPolicy
from .streaming import JobStream

__all__ = [
    "BATCH_DONE",
    "JOB_DONE",
    "ClientError",
    "ConnectionFailedError",
    "JobStream",
    "RetryPolicy",
    "RolloutClient",
    "WaitTimeoutError",
]
