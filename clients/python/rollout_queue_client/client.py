"""RolloutClient: jobs, synchronous generation and batches over the service's HTTP API."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import requests

from .errors import ClientError, ConnectionFailedError, WaitTimeoutError, error_from_response
from .retry import RetryPolicy
from .streaming import JobStream

JOB_DONE = frozenset({"succeeded", "failed", "cancelled"})
BATCH_DONE = frozenset({"completed", "failed", "cancelled", "expired"})
USER_AGENT = "rollout-queue-client/0.1"
DOWNLOAD_CHUNK = 64 * 1024
BULK_JOBS = 1000  # jobs in one POST /v1/jobs/bulk: the service's most (web.api.schemas.MAX_BULK_JOBS)
LONG_POLL_S = 20.0  # one wait request: under the service's default ROLLOUT_SYNC_TIMEOUT_MAX (300)
IDEMPOTENCY_KEY = "Idempotency-Key"
# The service's answer while the first submit with a key is still being made (README, API): sent again.
KEY_IN_USE = "idempotency_key_in_use"

BatchInput = str | os.PathLike | bytes | Iterable[Mapping[str, Any] | str]


class RolloutClient:
    """A client for one Rollout Queue service.

    ``timeout`` is the socket timeout of one HTTP request (seconds); waits have their own.
    ``session`` is the transport seam: pass a ``requests.Session`` with your own adapters, proxies
    or certificates.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, *,
                 timeout: float = 30.0, retry: RetryPolicy | None = None,
                 session: requests.Session | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._session = session or requests.Session()
        self._headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- Jobs -----------------------------------------------------------------------------------

    def submit(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Submit a job (``kind`` generate or score); the job, status ``queued``. Sent again after a
        connection error or a timeout with its ``Idempotency-Key``, it makes one job."""
        return self._submit("/v1/jobs", dict(request)).json()

    def submit_many(self, requests: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Submit many jobs (``POST /v1/jobs/bulk``, :data:`BULK_JOBS` a request): the jobs, in the
        order of ``requests``. The service creates a request's jobs in one round trip and queues them
        together, so a rollout step's jobs reach the GPU workers at once. Requests the queue caps
        refused are sent again after the service's ``Retry-After``, as a refused submit is; when the
        retries run out, a ``ClientError`` (``queue_full``) whose ``errors["jobs"]`` holds the jobs
        created so far (None for the refused)."""
        requests = [dict(request) for request in requests]
        jobs: list[dict[str, Any] | None] = [None] * len(requests)
        waiting = list(range(len(requests)))
        retries = 0
        while True:
            refused, retry_after = [], None
            for start in range(0, len(waiting), BULK_JOBS):
                part = waiting[start:start + BULK_JOBS]
                response = self._submit("/v1/jobs/bulk", {"jobs": [requests[i] for i in part]})
                body = response.json()
                for index, job in zip(part, body["data"], strict=True):
                    jobs[index] = job
                refused += [part[entry["index"]] for entry in body["refused"]]
                retry_after = response.headers.get("Retry-After") or retry_after
            if not refused:
                return jobs
            if retries >= self.retry.max_retries:
                raise ClientError("queue_full", f"{len(refused)} of {len(requests)} jobs were refused by the queue caps",
                                  status=429, errors={"jobs": jobs})
            retries += 1
            time.sleep(self.retry.delay(retries, retry_after))
            waiting = refused

    def get(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}", idempotent=True).json()

    def lookup(self, job_ids: Iterable[str], wait: float = 0.0) -> dict[str, Any]:
        """Many jobs in one request (``POST /v1/jobs/lookup``, at most 1,000 ids): ``{data,
        missing}``; with ``wait``, the service answers once every one has ended or after ``wait`` s."""
        body: dict[str, Any] = {"ids": list(job_ids)}
        if wait:
            body["wait"] = wait
        return self._request("POST", "/v1/jobs/lookup", json=body, timeout=(self.timeout, self.timeout + wait),
                             idempotent=True).json()

    def wait_many(self, job_ids: Iterable[str], timeout: float | None = None,
                  poll_interval: float = 0.5) -> list[dict[str, Any]]:
        """Wait until every job of ``job_ids`` has ended (a rollout step's, after
        :meth:`submit_many`): the jobs in the order of ``job_ids``. Long polls ``POST
        /v1/jobs/lookup`` (:data:`BULK_JOBS` ids and :data:`LONG_POLL_S` a request), asking again
        only for the jobs still running; ``poll_interval`` paces only a wait the service cut
        short. WaitTimeoutError after ``timeout`` s; a ``ClientError`` (``not_found``, ``errors
        ["missing"]``) for ids that are no job of this key's."""
        given = list(job_ids)
        ids = list(dict.fromkeys(given))
        ended: dict[str, dict[str, Any]] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while running := [job_id for job_id in ids if job_id not in ended]:
            started = time.monotonic()
            wait = LONG_POLL_S if deadline is None else round(min(LONG_POLL_S, max(deadline - started, 0.0)), 3)
            body = self.lookup(running[:BULK_JOBS], wait=wait)
            if body["missing"]:
                raise ClientError("not_found", f"{len(body['missing'])} ids are no job of this key's", status=404,
                                  errors={"missing": body["missing"]})
            before = len(ended)
            ended.update((job["id"], job) for job in body["data"] if job["status"] in JOB_DONE)
            left = len(ids) - len(ended)
            if left and deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"{left} of {len(ids)} jobs still running when the wait ran out")
            if left and len(ended) == before and time.monotonic() - started < wait / 2:  # cut short: no spin
                _sleep_until_next(deadline, poll_interval, f"{left} of {len(ids)} jobs still running")
        return [ended[job_id] for job_id in given]

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/jobs/{job_id}", idempotent=True).json()

    def wait(self, job_id: str, timeout: float | None = None, poll_interval: float = 0.5) -> dict[str, Any]:
        """Wait until the job ends (whatever its end); raises WaitTimeoutError after ``timeout`` s.

        Long polls (``GET /v1/jobs/{id}?wait=S``, at most :data:`LONG_POLL_S` a request): the
        service answers the moment the job ends, in one request where polling took one per
        ``poll_interval``; that interval now only paces the retry of a wait the service cut short."""
        return self._long_poll(f"/v1/jobs/{job_id}", JOB_DONE, f"job {job_id}", timeout=timeout,
                               longest=LONG_POLL_S, retry=poll_interval)

    def stream(self, job: str | Mapping[str, Any], *, last_event_id: str | None = None) -> JobStream:
        """Follow a job's events (a job id, or a request to submit first): iterate the returned
        :class:`JobStream` for ``status``, ``restart``, ``tokens`` and the final ``result`` events
        (a failed job raises ``ClientError`` with its code); it keeps ``token_ids`` and ``text`` by
        choice and reconnects with ``Last-Event-ID``. Leaving it cancels nothing."""
        job_id = job if isinstance(job, str) else self.submit({**job, "stream_events": True})["id"]
        return JobStream(self, job_id, last_event_id=last_event_id)

    def generate(self, request: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Generate (or score) and return the result (``POST /v1/generate``): ``{request_id, job_id,
        prompt_token_ids, choices, usage}``. When the service answers 202 (still running), keeps
        waiting by polling the job until ``timeout`` seconds have passed in all.
        Raises ClientError with the job's error code if the job fails."""
        started = time.monotonic()
        body = {**request, "timeout": timeout}
        response = self._submit("/v1/generate", body, timeout=(self.timeout, timeout + self.timeout))
        if response.status_code == 200:
            return response.json()
        job = self.wait(_job_id(response), timeout=max(timeout - (time.monotonic() - started), 0.0))
        if job["status"] == "failed":
            error = job.get("error") or {}
            raise ClientError(error.get("code", "job_failed"), error.get("message", "the job failed"))
        result = job.get("result") or {}
        return {"request_id": job.get("request_id"), "job_id": job["id"],
                "prompt_token_ids": result.get("prompt_token_ids"), "choices": result.get("choices"),
                "usage": result.get("usage")}

    # --- Batches --------------------------------------------------------------------------------

    def batch_submit(self, file: BatchInput, *, completion_window: str | int | None = None,
                     metadata: Mapping[str, Any] | None = None,
                     webhook: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Upload a JSONL batch: a path, the file's bytes, or lines (dicts or JSON strings).

        Each line is ``{"custom_id": ..., "kind": "generate" | "score", "body": <job request>}``.
        Returns the batch (``errors.data`` lists the first invalid lines, if any).
        """
        params: dict[str, str] = {}
        if completion_window is not None:
            params["completion_window"] = str(completion_window)
        if metadata is not None:
            params["metadata"] = json.dumps(dict(metadata))
        if webhook is not None:
            params["webhook"] = json.dumps(dict(webhook))
        response = self._request("POST", "/v1/batches", data=_jsonl_bytes(file), params=params,
                                 headers={"Content-Type": "application/jsonl"})
        return response.json()

    def batch_get(self, batch_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/batches/{batch_id}", idempotent=True).json()

    def batch_list(self, *, limit: int = 20, cursor: str | None = None, status: str | None = None) -> dict[str, Any]:
        """One page of your batches, newest first: ``{data, next_cursor}``."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        if status:
            params["status"] = status
        return self._request("GET", "/v1/batches", params=params, idempotent=True).json()

    def batch_cancel(self, batch_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/batches/{batch_id}/cancel", idempotent=True).json()

    def batch_wait(self, batch_id: str, *, timeout: float | None = None, poll_interval: float = 2.0,
                   progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Wait until the batch ends; ``progress(batch)`` is called after every answer.

        Long polls (``GET /v1/batches/{id}?wait=S``, S = ``poll_interval``): the service answers the
        moment the batch ends, else after S seconds with the counts so far."""
        return self._long_poll(f"/v1/batches/{batch_id}", BATCH_DONE, f"batch {batch_id}", timeout=timeout,
                               longest=poll_interval, retry=poll_interval, progress=progress)

    def batch_download(self, batch_id: str, output_path: str | os.PathLike | None = None,
                       errors_path: str | os.PathLike | None = None) -> dict[str, int]:
        """Write the output and/or error lines (JSONL) to files; the number of lines of each."""
        counts: dict[str, int] = {}
        for which, path in (("output", output_path), ("errors", errors_path)):
            if path is not None:
                counts[which] = self._download(f"/v1/batches/{batch_id}/{which}", Path(path))
        return counts

    def batch_results(self, batch_id: str, which: str = "output") -> Iterator[dict[str, Any]]:
        """The batch's output (or ``which="errors"``) lines as dicts, streamed."""
        if which not in ("output", "errors"):
            raise ValueError("which must be 'output' or 'errors'")
        with self._request("GET", f"/v1/batches/{batch_id}/{which}", stream=True, idempotent=True) as response:
            for line in response.iter_lines():
                if line:
                    yield json.loads(line)

    # --- HTTP -----------------------------------------------------------------------------------

    def _long_poll(self, path: str, done: frozenset[str], what: str, *,
                   timeout: float | None, longest: float, retry: float,
                   progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """GET ``path?wait=S`` (S at most ``longest``) until the record's status is in ``done``;
        WaitTimeoutError after ``timeout`` seconds. ``retry`` paces only the retry of a wait the
        service cut short (its ROLLOUT_SYNC_TIMEOUT_MAX is below S)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            started = time.monotonic()
            wait = longest if deadline is None else round(min(longest, max(deadline - started, 0.0)), 3)
            record = self._request("GET", path, params={"wait": wait} if wait else None,
                                   timeout=(self.timeout, self.timeout + wait), idempotent=True).json()
            if progress is not None:
                progress(record)
            if record["status"] in done:
                return record
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeoutError(f"{what} still {record['status']} when the wait ran out")
            if time.monotonic() - started < wait / 2:  # answered early without an end: do not spin
                _sleep_until_next(deadline, retry, f"{what} still {record['status']}")

    def _download(self, path: str, target: Path) -> int:
        lines = 0
        partial = target.with_name(target.name + ".part")
        with self._request("GET", path, stream=True, idempotent=True) as response, partial.open("wb") as out:
            for chunk in response.iter_content(DOWNLOAD_CHUNK):
                out.write(chunk)
                lines += chunk.count(b"\n")
        partial.replace(target)
        return lines

    def _submit(self, path: str, body: dict[str, Any], *, timeout: Any = None) -> requests.Response:
        """POST a submit with an ``Idempotency-Key`` of its own: whatever becomes of a connection, the
        service makes its jobs once, so it is sent again like a read."""
        return self._request("POST", path, json=body, headers={IDEMPOTENCY_KEY: str(uuid.uuid4())}, timeout=timeout,
                             idempotent=True)

    def _request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                 params: Mapping[str, Any] | None = None, headers: Mapping[str, str] | None = None,
                 stream: bool = False, timeout: Any = None, idempotent: bool = False) -> requests.Response:
        """Send, retrying 429/503 (and connection failures and timeouts when ``idempotent``: a read, or
        a submit with its Idempotency-Key); raises ClientError."""
        url = self.base_url + path
        all_headers = {**self._headers, **(headers or {})}
        retries = 0
        while True:
            try:
                response = self._session.request(method, url, json=json, data=data, params=params,
                                                 headers=all_headers, stream=stream,
                                                 timeout=timeout or self.timeout)
            except (requests.ConnectionError, requests.Timeout) as exc:
                if idempotent and retries < self.retry.max_retries:
                    retries += 1
                    time.sleep(self.retry.delay(retries))
                    continue
                raise ConnectionFailedError(f"{method} {url}: {exc.__class__.__name__}") from exc
            if _retryable(response, self.retry.statuses) and retries < self.retry.max_retries:
                retries += 1
                delay = self.retry.delay(retries, response.headers.get("Retry-After"))
                response.close()
                time.sleep(delay)
                continue
            if response.status_code >= 400:
                error = error_from_response(response)
                response.close()
                raise error
            return response


def _retryable(response: requests.Response, statuses: tuple[int, ...]) -> bool:
    """429 and 503; and a 409 whose key's first submit is still being made (it answers shortly)."""
    if response.status_code in statuses:
        return True
    if response.status_code != 409 or IDEMPOTENCY_KEY not in response.request.headers:
        return False
    try:
        return response.json().get("code") == KEY_IN_USE
    except (ValueError, AttributeError):
        return False


def _job_id(accepted: requests.Response) -> str:
    """The job of a 202 from /v1/generate: its ``id``, else the last part of its ``Location``."""
    body = accepted.json()
    if isinstance(body, dict) and body.get("id"):
        return body["id"]
    location = accepted.headers.get("Location", "")
    if not location.rstrip("/"):
        raise ClientError("invalid_response", "202 without a job id or Location", status=accepted.status_code)
    return location.rstrip("/").rsplit("/", 1)[-1]


def _sleep_until_next(deadline: float | None, interval: float, what: str) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimeoutError(f"{what} when the wait ran out")
        interval = min(interval, left)
    time.sleep(interval)


def _jsonl_bytes(file: BatchInput) -> bytes:
    if isinstance(file, bytes):
        return file
    if isinstance(file, str | os.PathLike):
        return Path(file).read_bytes()
    out = []
    for line in file:
        out.append(line if isinstance(line, str) else json.dumps(line, separators=(",", ":")))
    return ("\n".join(out) + "\n").encode()
