"""Qwen-VL video features from the Qwen image processor, without torchvision.

The stock Qwen video processors need torchvision (see ``processors.hf_processors``). Their
layout is the image processor's applied to frames, with consecutive frames paired into one
temporal patch: the image processor writes every frame as a patch duplicated in time
(``(C, temporal, patch, patch)`` per row), so the duplicate is dropped and each pair of frames
interleaved back in. Written here because no library does it without torchvision; the tests
check the result against the stock video processor's patch layout and against the model.

Frame sizes follow the checkpoint's ``video_preprocessor_config.json`` when it has one (the stock
minimum of 128·28·28 pixels would blow a tiny clip up to hundreds of tokens per frame pair), else
the image processor's own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from processors.decode import DecodedVideo
from processors.errors import ItemLayoutError


def video_size(model_dir: Path) -> dict[str, int] | None:
    """``{"shortest_edge": min pixels, "longest_edge": max pixels}`` from the checkpoint's video
    processor config, or None to use the image processor's."""
    path = Path(model_dir) / "video_preprocessor_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    size = dict(config.get("size") or {})
    low = config.get("min_pixels", size.get("shortest_edge"))
    high = config.get("max_pixels", size.get("longest_edge"))
    return {"shortest_edge": int(low), "longest_edge": int(high)} if low and high else None


def qwen_video_features(
    image_processor, videos: Sequence[DecodedVideo], options: Mapping[str, Any], size: dict[str, int] | None
) -> dict[str, torch.Tensor]:
    """``pixel_values_videos`` (all videos' patch rows) and ``video_grid_thw`` (one row each)."""
    temporal, patch = image_processor.temporal_patch_size, image_processor.patch_size
    kwargs = {**({"size": size} if size else {}), **options}
    rows, grids = [], []
    for video in videos:
        frames = video.frames
        if pad := -len(frames) % temporal:  # as the stock processor: repeat the last frame
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        out = image_processor(images=[Image.fromarray(f) for f in frames], return_tensors="pt", **kwargs)
        count = len(frames)
        _, grid_h, grid_w = out["image_grid_thw"][0].tolist()
        per_frame = grid_h * grid_w
        pixels = out["pixel_values"].view(count, per_frame, 3, temporal, patch, patch)[:, :, :, 0]
        pixels = (
            pixels.reshape(count // temporal, temporal, per_frame, 3, patch, patch)
            .permute(0, 2, 3, 1, 4, 5)
            .reshape(count // temporal * per_frame, 3 * temporal * patch * patch)
        )
        rows.append(pixels)
        grids.append([count // temporal, grid_h, grid_w])
    return {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids, dtype=torch.int64)}


def seconds_per_grid(image_processor, videos: Sequence[DecodedVideo]) -> torch.Tensor:
    """Seconds of video one temporal patch spans, per video (``temporal / fps``), as the Qwen2.5
    processors compute it from the sampling rate."""
    return torch.tensor([image_processor.temporal_patch_size / video.fps for video in videos], dtype=torch.float32)


def split_by_grid(features: Mapping[str, torch.Tensor], pixels: str, grid: str, per_item: Sequence[str] = ()):
    """One feature dict per video: its patch rows, its grid row and its entry of ``per_item``."""
    grids = features[grid]
    counts = grids.prod(dim=-1).tolist()
    if features[pixels].shape[0] != sum(counts):
        raise ItemLayoutError(f"{pixels} has {features[pixels].shape[0]} patch rows, the grids need {sum(counts)}")
    return [
        {pixels: part, grid: grids[i:i + 1], **{name: features[name][i:i + 1] for name in per_item}}
        for i, part in enumerate(features[pixels].split(counts, dim=0))
    ]
