"""Errors of the model processors.

    engine.errors.InvalidRequestError (422)
    ├── PlaceholderMismatchError        placeholder_mismatch   (engine.errors)
    ├── InvalidFeaturesError            invalid_features       precomputed ``features`` malformed
    └── UnsupportedModalityError        unsupported_modality   e.g. a video for an image-only model
    engine.errors.InternalError (500)
    ├── UnsupportedModelError           unsupported_model      no processor for the architecture
    └── ItemLayoutError                 item_layout            items, features and offsets disagree

``PlaceholderCountError`` is internal control flow, not part of the tree: the fast placeholder
path raises it and the caller either falls back to the authoritative path (the full HF processor
over the raw prompt) or turns it into :class:`~engine.errors.PlaceholderMismatchError`.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import InternalError, InvalidRequestError


class PlaceholderCountError(Exception):
    """The prompt's placeholders do not line up with its media items (internal: never shown)."""

    def __init__(self, *, placeholders: int, items: int, detail: str = ""):
        super().__init__(f"{placeholders} placeholders for {items} items{': ' + detail if detail else ''}")
        self.placeholders = placeholders
        self.items = items
        self.detail = detail


class InvalidFeaturesError(InvalidRequestError):
    """Precomputed ``features`` do not match the declared format or what the model takes."""

    code = "invalid_features"


class UnsupportedModalityError(InvalidRequestError):
    code = "unsupported_modality"


class UnsupportedModelError(InternalError):
    """No multimodal processor is registered for the model's architecture."""

    code = "unsupported_model"

    def __init__(self, message: str, *, architecture: str | None, supported: Sequence[str]):
        super().__init__(message)
        self.architecture = architecture
        self.supported = list(supported)


class ItemLayoutError(InternalError):
    """A model hook found items, features and placeholder offsets that do not add up (a bug)."""

    code = "item_layout"
