"""Image prompts by hand for every demo architecture (token ids matching the image's features)."""

from __future__ import annotations


def image_tokens(arch: str, config, tokenizer, features: dict) -> list[int]:
    """The token ids an image needs in ``arch``, built from its processor's features."""
    if arch.startswith("qwen"):
        n = int(features["image_grid_thw"].prod()) // 4
        return [config.vision_start_token_id, *[config.image_token_id] * n, config.vision_end_token_id]
    if arch == "llava":
        return [config.image_token_index] * config.image_seq_length
    # pixtral: rows of [IMG] closed by [IMG_BREAK], the last one by [IMG_END]
    height, width = features["image_sizes"][0].tolist()
    image = []
    for _ in range(height // 16):
        image += [config.image_token_index] * (width // 16) + [tokenizer.convert_tokens_to_ids("[IMG_BREAK]")]
    image[-1] = tokenizer.convert_tokens_to_ids("[IMG_END]")
    return image
