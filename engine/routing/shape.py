"""A model's routing shape from its config alone (no torch, no weights): how many layers route,
how many experts each token takes there, and of how many. What the API bounds a result by
(engine/result_bound.py) before the model runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingShape:
    layers: int  # MoE layers, in order
    top_k: int
    num_experts: int

    @property
    def bytes_per_token(self) -> int:
        """Packed bytes of one position's ids (engine/routing/encoding.py)."""
        width = 1 if self.num_experts <= 256 else 2 if self.num_experts <= 2**15 else 4
        return self.layers * self.top_k * width


def routing_shape(config) -> RoutingShape | None:
    """Qwen3-MoE's and Qwen2-MoE's rule: layer i routes unless it is in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0``; None for a model without experts."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts, top_k = getattr(text, "num_experts", 0) or 0, getattr(text, "num_experts_per_tok", 0) or 0
    if experts <= 0 or top_k <= 0:
        return None
    step, dense = getattr(text, "decoder_sparse_step", 1) or 1, set(getattr(text, "mlp_only_layers", ()) or ())
    layers = sum(1 for i in range(text.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return RoutingShape(layers, top_k, experts) if layers else None


def check_routing_asked(params, routed_bytes_per_token: int) -> None:
    """The API's refusal (422) of ``routed_experts`` on a model without MoE layers, before it runs."""
    from engine.errors import InvalidRequestError

    if params.get("routed_experts") and not routed_bytes_per_token:
        raise InvalidRequestError("routed_experts needs a mixture-of-experts model; this one has no MoE layers",
                                  errors={"sampling_params": {"routed_experts": ["this model has no MoE layers"]}})
