"""Collate prompts (with their media) into one left-padded batch for the model.

Left padding puts every row's last token in the last column, which is what ``generate`` needs,
and lets scoring keep only the last logits. Media features of all rows are concatenated along
dim 0 in row order: models consume them in the order their placeholders appear in the
flattened batch (Qwen-VL's rope index walks ``image_grid_thw`` the same way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError, PlaceholderMismatchError, check_token_ids
from engine.items import MultimodalItem, placeholder_range
from engine.loading import LoadedModel
from engine.model_facts import ModelFacts
from engine.model_inputs import build_mm_kwargs
from engine.request_rules import check_context

# Per-token inputs the engine builds itself from the token ids; a caller's copy is not collated.
_PER_TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "position_ids", "mm_token_type_ids"})
_MODALITY_TYPE = {"image": 1, "video": 2}  # transformers' mm_token_type_ids values; text is 0


@dataclass
class Row:
    token_ids: Sequence[int]
    features: Mapping[str, torch.Tensor]
    adapter: str = ""  # the LoRA adapter the row runs under (engine/lora/); "" is the base


def request_features(
    items: Sequence[MultimodalItem] | None, mm_kwargs: Mapping[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """The model-input features of one request, from finalized items or ready-made kwargs."""
    if items and mm_kwargs:
        raise InvalidRequestError("give media as items or as mm_kwargs, not both")
    if items:
        return build_mm_kwargs(items)
    return {k: v for k, v in (mm_kwargs or {}).items() if k not in _PER_TOKEN_KEYS}


def check_prompt(facts: ModelFacts, prompt_token_ids: Sequence[int], new_tokens: int) -> None:
    """Reject an empty prompt, an id outside the vocabulary, or a prompt that with ``new_tokens``
    more exceeds the context."""
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("prompt_token_ids must not be empty")
    check_token_ids(prompt_token_ids, facts.vocab_size, "prompt_token_ids")
    check_context(len(prompt_token_ids), new_tokens, facts.context_tokens)


def check_placeholders(
    facts: ModelFacts,
    prompt_token_ids: Sequence[int],
    features: Mapping[str, torch.Tensor],
    completion_token_ids: Sequence[int] = (),
) -> None:
    """Reject media placeholders without media, media without placeholders, and placeholder ids
    in a scored completion.

    transformers models take every placeholder id in the batch for a media slot: one stray
    placeholder would shift every neighbour's media in the batch, so it is refused per request.
    Counting placeholders per item is the processors' job (it is model specific).
    """
    media_ids = set(facts.media_token_ids.values())
    placeholders = sum(1 for t in prompt_token_ids if t in media_ids)
    if bool(placeholders) != bool(features):
        raise PlaceholderMismatchError(
            f"the prompt has {placeholders} media placeholder tokens but "
            f"{'media' if features else 'no media'} was given",
            placeholders=placeholders,
            items=1 if features else 0,
        )
    if any(t in media_ids for t in completion_token_ids):
        raise InvalidRequestError(
            "completion_token_ids contain a media placeholder id, which cannot be scored",
            errors={"completion_token_ids": sorted(media_ids & set(completion_token_ids))},
        )


def concat_rows(per_row: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The batch's features: each row's features, in row order, concatenated along dim 0.

    ``build_mm_kwargs`` already concatenates in offset order and pads features of different
    trailing sizes (Pixtral images) the way the image processors pad a batch; each row is handed
    to it as one item at offset (row, row + 1), so rows keep their order.
    """
    return build_mm_kwargs([
        MultimodalItem("batch_row", features=dict(features), offset=(row, row + 1))
        for row, features in enumerate(per_row)
        if features
    ])


def collate(loaded: LoadedModel, rows: Sequence[Row]) -> dict[str, torch.Tensor]:
    """Model kwargs for ``rows``: input_ids, attention_mask, media features (and the per-token
    ``mm_token_type_ids`` where the model takes them), left-padded, on the model's device."""
    width = max(len(row.token_ids) for row in rows)
    input_ids = torch.full((len(rows), width), loaded.fill_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row.token_ids:
            input_ids[i, width - len(row.token_ids):] = torch.as_tensor(list(row.token_ids), dtype=torch.long)
            attention_mask[i, width - len(row.token_ids):] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    features = concat_rows([row.features for row in rows])
    if features and loaded.uses_mm_token_type_ids:
        batch["mm_token_type_ids"] = _mm_token_type_ids(loaded, input_ids, attention_mask)
    batch.update(features)
    return {k: _to_device(v, loaded, k) for k, v in batch.items()}


def prompt_positions(loaded: LoadedModel, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' own positions for a left-padded ``batch`` seen whole (a prefill, or a scored
    sequence) and, for M-RoPE models, each row's rope delta (``get_rope_index``'s, left on the
    model as ``rope_deltas``): a padded row sees the positions it would see alone, media included.
    The caller holds ``loaded.lock`` or owns the model (the deltas are left on it)."""
    model = loaded.model
    model_kwargs = {name: value for name, value in batch.items() if name != "input_ids"}
    with torch.inference_mode():
        positions = model._prepare_position_ids_for_generation(batch["input_ids"], model_kwargs)
    if positions.dim() == 3:
        return positions, model.model.rope_deltas.reshape(-1)
    return positions, None


def _mm_token_type_ids(loaded: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    # As the Qwen-VL processors build them: by placeholder id. Scored completions are text (0)
    # because check_placeholders refuses placeholder ids in them.
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    for modality, token_id in loaded.media_token_ids.items():
        if modality in _MODALITY_TYPE:
            types[input_ids == token_id] = _MODALITY_TYPE[modality]
    return types * attention_mask


# Seconds per temporal patch feed the M-RoPE time index, floored after scaling: bf16 would shift it.
_KEEP_DTYPE = frozenset({"second_per_grid_ts", "video_second_per_grid"})


def _to_device(value: torch.Tensor, loaded: LoadedModel, name: str = "") -> torch.Tensor:
    if value.is_floating_point() and name not in _KEEP_DTYPE:
        # Pixel values follow the model's dtype (bf16 weights take bf16 pixels).
        return value.to(device=loaded.device, dtype=loaded.dtype)
    return value.to(loaded.device)


def placeholder_ranges(
    facts: ModelFacts, token_ids: Sequence[int], items: Sequence[MultimodalItem] = ()
) -> list[dict]:
    """Media placeholder ranges of a prompt (``engine.items.placeholder_range``): the items' own
    offsets when given, else the runs of the model's media token ids."""
    if items:
        return [placeholder_range(item.modality, *item.offset) for item in items]
    modality_of = {token_id: modality for modality, token_id in facts.media_token_ids.items()}
    runs: list[list] = []  # [modality, start, end]
    for pos, token in enumerate(token_ids):
        modality = modality_of.get(token)
        if modality is None:
            continue
        if runs and runs[-1][0] == modality and runs[-1][2] == pos:
            runs[-1][2] = pos + 1
        else:
            runs.append([modality, pos, pos + 1])
    return [placeholder_range(*run) for run in runs]
