"""Jobs of one key that pass no check but the engine's, written through the submission layer as if
the API had let them through (shared by tests/workers/gpu/test_isolation.py and the e2e tests)."""

from __future__ import annotations

import dataclasses
import json

from domain.jobs.request import JobRequest
from domain.jobs.submission import submit_job
from domain.names import GENERATE_TASK, SHARED_GENERATE_QUEUE
from web.api.schemas import SamplingParamsSchema

GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
DEFAULT_SAMPLING = SamplingParamsSchema().load({})  # as the API stores a request's sampling_params


def stored_request(**request) -> dict:
    """A request as the API would store it, sampling parameters filled in."""
    return {"kind": "generate", **request,
            "sampling_params": {**DEFAULT_SAMPLING, **GREEDY, **request.get("sampling_params", {})}}


def plant_job(jobs, celery, facts, owner: str, **request) -> str:
    """A job with ids the API would refuse: submitted as if the vocabulary were huge, so plain token
    ids go straight to the GPU queue."""
    trusting = dataclasses.replace(facts, vocab_size=10**9)
    return submit_job(jobs, celery, owner=owner, request=JobRequest.from_dict(stored_request(**request)),
                      model=trusting)["id"]


def plant_mismatched_image_job(jobs, celery, owner: str, *, processor, fetcher, image_url: str) -> str:
    """An image job whose stored prompt lost one image placeholder: the model itself raises (an
    untyped RuntimeError, features and placeholders do not match), which no check catches first."""
    from domain.jobs.prompt_codec import encode_prompt
    from engine.limits import Limits
    from engine.transport import InlineTransport
    from processors.pipeline import preprocess

    request = stored_request(prompt="<image>Describe it.", content_parts=[{"type": "image_url", "url": image_url}])
    processed = preprocess(request, processor=processor, fetcher=fetcher, cache=None, transport=InlineTransport(),
                           limits=Limits())
    processed.prompt_token_ids.remove(processor.image_token_id)
    job = jobs.create(owner=owner, kind="generate", request=request, request_id=None,
                      prompt=json.dumps(encode_prompt(processed, preprocess_seconds=0.0, node_id="test")))
    celery.send_task(GENERATE_TASK, args=[job["id"]], queue=SHARED_GENERATE_QUEUE)
    return job["id"]
