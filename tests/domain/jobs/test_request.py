"""The typed job request (domain.jobs.request): one mapping from API meaning to engine meaning,
the same for a request at the edge and for a record a worker reads back."""

from __future__ import annotations

import pytest

from domain.jobs.request import JobRequest
from engine.errors import Fault, InvalidRequestError
from tests.workers.bad_rows import stored_request


def test_api_meanings_become_engine_meanings_once():
    request = JobRequest.from_dict(stored_request(token_ids=[5, 6], sampling_params={"top_k": -1, "stop": ["\n"]}))
    assert request.sampling.top_k == 0  # -1 (vLLM's "off") is the engine's 0
    assert request.sampling.stop == ("\n",)
    assert request.kind == "generate" and request.token_ids == [5, 6] and not request.has_media


def test_the_record_is_the_validated_dict_and_reads_back_the_same():
    validated = stored_request(prompt="<image>hi", content_parts=[{"type": "image_url", "url": "https://x.test/a.png"}],
                               metadata={"step": 3}, request_id="r-1")
    request = JobRequest.from_dict(validated)
    assert request.to_record() is validated
    again = JobRequest.from_dict(request.to_record())
    assert again == request and again.has_media and again.metadata == {"step": 3}
    assert request.processor_input() == {"prompt": "<image>hi", "content_parts": validated["content_parts"]}


def test_a_record_stored_before_a_knob_existed_reads_with_its_default():
    old = stored_request(token_ids=[1])
    del old["sampling_params"]["repetition_penalty"], old["sampling_params"]["stop"]
    params = JobRequest.from_dict(old).sampling
    assert params.repetition_penalty == 1.0 and params.stop == ()


def test_sampling_the_engine_refuses_is_a_422_naming_the_field():
    with pytest.raises(InvalidRequestError) as refused:
        JobRequest.from_dict(stored_request(token_ids=[1], sampling_params={"max_tokens": 2, "min_tokens": 3}))
    assert refused.value.fault is Fault.INVALID and "min_tokens" in refused.value.errors
