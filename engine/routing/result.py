"""What a request's result carries of its routing: the refusal of a request that asks a model
without MoE layers, and each choice's packed ids (engine/routing/encoding.py)."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.routing.encoding import pack


def check_routed(capture, params) -> None:
    """``routed_experts`` on a model without MoE layers is refused (a 4xx, before it runs).
    ``capture``: the model's (engine.routing.capture.router_capture); ``params``: anything with a
    ``routed_experts`` flag."""
    if params.routed_experts and capture is None:
        raise InvalidRequestError("routed_experts needs a mixture-of-experts model; this one has no MoE layers",
                                  errors={"routed_experts": ["this model has no MoE layers"]})


def choice_routing(row, prompt_len: int) -> dict | None:
    """A row's packed ids for every position fed to the model (prompt + output - 1), or what was
    recorded of them for a row that ended before its prompt ran; None unless it asked."""
    if row.routing is None:
        return None
    positions = min(prompt_len + max(len(row.token_ids) - 1, 0), row.routing.filled)
    return pack(row.routing.array(positions)) if positions else None
