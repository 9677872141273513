"""Checkpoint tensors that transformers fuses on load (Qwen3-MoE: each expert's ``gate_proj`` and
``up_proj`` concatenated into one ``gate_up_proj`` per layer), so that an in-place weight update
can write them: where each checkpoint tensor's elements lie in the model's tensor.

transformers reverts its own conversion (``revert_weight_conversion``, what ``save_pretrained``
writes), but its chunks are copies, not views. So the revert runs once over index tensors instead
of weights: the "weights" it reverts are each element's flat position, and what comes out names,
for every checkpoint tensor, the elements of the fused tensor it fills. Costs 8 bytes of host
memory per fused element for the length of an update."""

from __future__ import annotations

from bisect import bisect_right

import torch


class FusedPart:
    """One checkpoint tensor inside a fused model tensor (``owner``), at the flat ``index``; quacks
    like the target tensor :func:`engine.weights.load_weights` copies into."""

    def __init__(self, owner: torch.Tensor, index: torch.Tensor):
        self.owner, self.index = owner, index
        self.shape, self.dtype = index.shape, owner.dtype

    def is_floating_point(self) -> bool:
        return self.owner.is_floating_point()

    def numel(self) -> int:
        return self.index.numel()

    def untyped_storage(self):
        return self.owner.untyped_storage()

    def storage_offset(self) -> int:
        return self.owner.storage_offset() + int(self.index.reshape(-1)[0])

    def copy_(self, source: torch.Tensor) -> None:
        self.owner.view(-1).index_copy_(0, self.index.reshape(-1).to(self.owner.device),
                                        source.reshape(-1).to(device=self.owner.device, dtype=self.owner.dtype))


def fused_parts(model, own: dict[str, torch.Tensor], fused: list[str], wanted: list[str]) -> dict[str, FusedPart]:
    """``{checkpoint name: FusedPart}`` for the ``wanted`` names, which the revert of the ``fused``
    model tensors (names in ``own``) makes; a name it does not place inside one is left out."""
    from transformers.core_model_loading import revert_weight_conversion

    starts, total = [], 0
    for name in fused:
        starts.append(total)
        total += own[name].numel()
    positions = {name: torch.arange(start, start + own[name].numel()).reshape(own[name].shape)
                 for name, start in zip(fused, starts, strict=True)}
    reverted = revert_weight_conversion(model, positions)
    parts = {}
    for name in wanted:
        index = reverted.get(name)
        if index is None or index.dtype != torch.int64 or index.numel() == 0:
            continue
        which = bisect_right(starts, int(index.min())) - 1
        owner, start = own[fused[which]], starts[which]
        if int(index.max()) >= start + owner.numel():  # spans two fused tensors: not one target
            continue
        parts[name] = FusedPart(owner, index - start)
    return parts
