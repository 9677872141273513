"""Media to model inputs: the guarded fetcher (``processors.fetch``), decoders
(``processors.decode``), one processor per model family (``processors.registry``), the
preprocessing pipeline that turns a request's prompt and media into a finalized prompt, chat
rendering, and the multimodal cache.

What the worker layer uses is named in ``__all__`` and loaded on first use (PEP 562): importing
``processors`` loads neither transformers nor torch.
"""

from __future__ import annotations

from engine.lazy_surface import lazy_surface

_PUBLIC = {
    "preprocess": "processors.pipeline",
    "PreprocessLimits": "processors.pipeline",
    "load_processor": "processors.registry",
    "template_messages": "processors.chat_messages",
    "MultimodalCache": "processors.cache",
    "FetchPolicy": "processors.fetch",
    "GuardedFetcher": "processors.fetch",
    "VideoSampling": "processors.decode",
}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_surface(__name__, _PUBLIC)
