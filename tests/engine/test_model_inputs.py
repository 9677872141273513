"""build_mm_kwargs: finalized items (opened) to the model's multimodal keyword arguments."""

from __future__ import annotations

import pytest
import torch

from engine.items import MultimodalItem
from engine.model_inputs import build_mm_kwargs
from engine.transport import InlineTransport


def item(offset, **features):
    return MultimodalItem("image", features, offset)


def test_patches_and_grids_concatenate_in_prompt_order():
    a = item((10, 14), pixel_values=torch.ones(16, 4), image_grid_thw=torch.tensor([[1, 4, 4]]))
    b = item((2, 5), pixel_values=torch.zeros(12, 4), image_grid_thw=torch.tensor([[1, 2, 6]]))
    kwargs = build_mm_kwargs([a, b])
    assert kwargs["image_grid_thw"].tolist() == [[1, 2, 6], [1, 4, 4]]
    assert torch.equal(kwargs["pixel_values"], torch.cat([torch.zeros(12, 4), torch.ones(16, 4)]))


def test_images_of_different_sizes_are_zero_padded_to_the_largest():
    a = item((0, 3), pixel_values=torch.ones(1, 3, 2, 4), image_sizes=torch.tensor([[2, 4]]))
    b = item((3, 6), pixel_values=torch.full((1, 3, 3, 1), 2.0), image_sizes=torch.tensor([[3, 1]]))
    kwargs = build_mm_kwargs([a, b])
    assert kwargs["pixel_values"].shape == (2, 3, 3, 4)
    assert kwargs["pixel_values"][0, :, 2].abs().sum() == 0 and kwargs["pixel_values"][1, :, :, 1:].abs().sum() == 0
    assert kwargs["image_sizes"].tolist() == [[2, 4], [3, 1]]


def test_wrapped_and_inconsistent_features_are_refused():
    wrapped = item((0, 1), pixel_values=InlineTransport().wrap(torch.ones(1, 2)))
    with pytest.raises(TypeError, match="wrapped"):
        build_mm_kwargs([wrapped])
    with pytest.raises(ValueError, match="ranks or dtypes"):
        build_mm_kwargs([item((0, 1), x=torch.ones(1, 2)), item((1, 2), x=torch.ones(1, 2, 1))])
    assert build_mm_kwargs([]) == {}
