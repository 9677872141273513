"""The public shape of a job: what ``GET /v1/jobs/{id}`` returns and what webhooks carry, and
what ``GET /v1/jobs`` lists of each."""

from __future__ import annotations

from typing import Any

PUBLIC_FIELDS = ("id", "kind", "status", "created_at", "started_at", "completed_at", "request_id",
                 "metadata", "result", "error")


def public_job(job: dict[str, Any]) -> dict[str, Any]:
    view = {name: job.get(name) for name in PUBLIC_FIELDS}
    view["request_id"] = view["request_id"] or None
    view["object"] = "job"
    view["links"] = {"self": f"/v1/jobs/{job['id']}"}
    if job.get("batch_id"):
        view["batch_id"] = job["batch_id"]
        view["custom_id"] = job.get("custom_id")
    return view


def listed_job(job: dict[str, Any]) -> dict[str, Any]:
    """A job as ``GET /v1/jobs`` lists it: its public shape without ``result`` (one result may be
    tens of MB; ``GET /v1/jobs/{id}`` serves it), from the summary ``JobStore.list`` reads."""
    view = public_job(job)
    del view["result"]
    return view
