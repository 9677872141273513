"""The finalized prompt as it travels from the CPU worker to the GPU worker.

The CPU worker stores it as JSON under the job (``JobStore.prompt_key``); feature tensors are
transport handles (see ``engine.transport``), never tensor bytes in a Celery message. The GPU
worker opens the handles back into tensors before the model sees them, and acknowledges them
when the batch is done so the producer's pool can free the memory.

The engine's tensor side is imported inside the functions that wrap, open and release handles:
the API builds plain-text prompts (``text_prompt``) with this module and never imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from domain.infra.transport_acks import RedisAckChannel

if TYPE_CHECKING:
    from engine.items import MultimodalItem


def encode_prompt(processed, *, preprocess_seconds: float, node_id: str) -> dict[str, Any]:
    from engine.transport import WrappedFeature

    kinds = set()
    items = []
    for item in processed.items:
        features = {}
        for name, feature in item.features.items():
            if not isinstance(feature, WrappedFeature):
                raise TypeError(f"feature {name!r} was not wrapped: finalize must wrap every feature")
            kinds.add(feature.kind)
            features[name] = feature.handle
        items.append({"modality": item.modality, "offset": list(item.offset), "content_hash": item.content_hash,
                      "pad_value": item.pad_value, "features": features})
    # The job's transport is the least portable kind any feature uses.
    transport = next((kind for kind in ("cuda_ipc", "shm") if kind in kinds), "inline")
    return {
        "token_ids": list(processed.prompt_token_ids),
        "placeholder_ranges": list(processed.placeholder_ranges),
        "items": items,
        "transport": transport,
        "node_id": node_id,
        "timings": {"preprocess": preprocess_seconds, **(processed.timings or {})},
        "cache_hits": processed.cache_hits,
    }


def text_prompt(token_ids: list[int]) -> dict[str, Any]:
    """The finalized prompt of plain token ids: nothing to process, nothing to transport."""
    return {"token_ids": list(token_ids), "placeholder_ranges": [], "items": [], "transport": "inline",
            "node_id": "", "timings": {"preprocess": 0.0}, "cache_hits": 0}


@dataclass
class OpenedPrompt:
    token_ids: list[int]
    items: list[MultimodalItem]
    placeholder_ranges: list[dict]
    transport: str
    timings: dict[str, float]
    handles: list[dict] = field(default_factory=list)
    node_id: str = ""  # the node that preprocessed it


def open_prompt(payload: dict[str, Any], *, device=None) -> OpenedPrompt:
    """Open every feature handle (HandleUnavailableError when the producer's memory is gone)."""
    from engine.items import MultimodalItem
    from engine.transport import open_feature

    items, handles = [], []
    for raw in payload["items"]:
        # Held open (zero-copy) until release_prompts acknowledges them after the batch.
        tensors = {name: open_feature(handle, device=device, hold=True) for name, handle in raw["features"].items()}
        handles.extend(raw["features"].values())
        items.append(MultimodalItem(modality=raw["modality"], features=tensors, offset=tuple(raw["offset"]),
                                    content_hash=raw["content_hash"], pad_value=raw["pad_value"]))
    return OpenedPrompt(payload["token_ids"], items, payload["placeholder_ranges"], payload["transport"],
                        payload["timings"], handles, payload.get("node_id", ""))


def release_prompts(client, prompts: Iterable[OpenedPrompt]) -> None:
    """Tell the producers they may free these prompts' feature memory: one round trip for all."""
    release_handles(client, [handle for prompt in prompts for handle in prompt.handles])


def release_handles(client, handles: list[dict]) -> None:
    """Acknowledge feature handles through Redis (``domain/infra/transport_acks.py``)."""
    from engine.transport import acknowledge

    if handles:
        acknowledge(RedisAckChannel(client), handles)
