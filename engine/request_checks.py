"""What a scheduler refuses before a request is queued: everything that could never run on this
model and batch, each a typed error (checked at submission, so nothing is computed for it)."""

from __future__ import annotations

import torch

from engine.batch_inputs import check_placeholders, check_prompt, request_features
from engine.capacity import SchedulerLimits, check_capacity
from engine.errors import InvalidRequestError
from engine.grammar.for_request import check_grammar
from engine.lora.bank import check_adapter
from engine.model_facts import ModelFacts
from engine.routing.result import check_routed


def check_request(facts: ModelFacts, limits: SchedulerLimits, routing, request) -> dict[str, torch.Tensor]:
    """Refuse what can never run (typed errors); the request's model features otherwise.
    ``routing``: the runner's routed-experts capture, None for a model without one."""
    params = request.sampling
    check_prompt(facts, request.prompt_token_ids, params.max_tokens)
    features = request_features(request.items, request.mm_kwargs)
    check_placeholders(facts, request.prompt_token_ids, features)
    if params.stop and facts.tokenizer is None:
        raise InvalidRequestError("stop strings need the model's tokenizer, which this model directory lacks",
                                  errors={"stop": ["not supported by this model"]})
    check_capacity(limits, len(request.prompt_token_ids), params.max_tokens, params.n)
    check_grammar(facts, params)
    check_adapter(facts, request)
    check_routed(routing, params)
    return features
