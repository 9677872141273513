"""Forward hooks on every MoE layer's router: the top-k expert ids each token of a forward took.

The hook reads the ids the model itself routed by: transformers' Qwen3-MoE router returns
``(router_logits, routing_weights, router_indices)``, the indices being ``torch.topk`` over the
softmax of the logits, in the router's order (most weighted first). A router that returns only its
logits (an ``nn.Linear`` gate) gets the same top-k taken here. The hooks stay installed; a forward
no row of which asked records nothing (one attribute check per layer).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type holding every expert id (uint8 up to 256 experts)."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32


class RouterCapture:
    """The routers of one model, in layer order, and what they chose in the forward running now."""

    def __init__(self, routers: list[tuple[torch.nn.Module, int]], num_experts: int):
        self.layers, self.top_k = len(routers), routers[0][1]
        self.num_experts, self.dtype = num_experts, expert_dtype(num_experts)
        self._armed = False
        self._chosen: list[torch.Tensor] = []
        for router, top_k in routers:
            router.register_forward_hook(self._hook(top_k))

    def _hook(self, top_k: int):
        def record(module, args, output):
            if not self._armed:
                return
            if isinstance(output, tuple):  # (logits, weights, indices): the indices the model used
                ids = output[2]
            else:  # logits only: the model's own rule, top-k of the softmax
                ids = torch.topk(torch.softmax(output.float(), dim=-1), top_k, dim=-1).indices
            self._chosen.append(ids.reshape(-1, top_k))  # cast once for all layers in take()
        return record

    @contextmanager
    def recording(self, armed: bool):
        """Within: the forward's routing is recorded if ``armed``; :meth:`take` reads it after."""
        self._armed, self._chosen = armed, []
        try:
            yield
        finally:
            self._armed = False

    def take(self) -> torch.Tensor:
        """The last recorded forward's ids, (tokens, layers, k) in the forward's token order
        (row-major over its (batch, width) inputs); on the model's device."""
        chosen, self._chosen = self._chosen, []
        if len(chosen) != self.layers:
            raise RuntimeError(f"recorded {len(chosen)} MoE layers of {self.layers}")
        return torch.stack(chosen, dim=1).to(self.dtype)


def router_capture(model) -> RouterCapture | None:
    """``model``'s capture, its hooks installed once; None for a model without MoE layers."""
    if model in _CAPTURES:
        return _CAPTURES[model]
    routers, experts = [], 0
    for module in model.modules():
        gate, block_experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if gate is None or block_experts is None:
            continue
        top_k = getattr(gate, "top_k", None) or model.config.get_text_config().num_experts_per_tok
        experts = max(experts, getattr(gate, "num_experts", None) or model.config.get_text_config().num_experts)
        routers.append((gate, top_k))
    capture = RouterCapture(routers, experts) if routers else None
    _CAPTURES[model] = capture
    return capture
