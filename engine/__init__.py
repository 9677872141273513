"""The model side: load a Hugging Face model, generate and score with continuous batching, swap
weights in place, move features between processes (``engine.transport``), and the typed errors
every layer raises (``engine.errors``).

What the layers above use is named in ``__all__`` and loaded on first use (PEP 562), so that the
torch-free API can import ``engine.errors`` or ``engine.request_rules`` without loading torch.
Modules not reached from here are the engine's own parts (the scheduler, the KV batch, the caches).
"""

from __future__ import annotations

from engine.lazy_surface import lazy_surface

_PUBLIC = {
    # generating and scoring
    "Engine": "engine.generation",
    "GenerationRequest": "engine.generation_types",
    "SamplingParams": "engine.sampling_params",
    "ScoreRequest": "engine.scoring",
    "Choice": "engine.choice",
    "MultimodalItem": "engine.items",
    "IncrementalText": "engine.detokenize",
    "SchedulerLimits": "engine.capacity",
    # loading and checking a model
    "load_model": "engine.loading",
    "check_fidelity": "engine.fidelity",
    "build_demo_model": "engine.demo_model",
    "check_checkpoint": "engine.checkpoints",
    # the rules a request meets before any compute (torch-free)
    "context_limit": "engine.request_rules",
    "new_tokens_of": "engine.request_rules",
    "check_context": "engine.request_rules",
    # errors: one code and HTTP status each
    "RolloutError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "NotFoundError": "engine.errors",
    "ServiceUnavailableError": "engine.errors",
}

__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_surface(__name__, _PUBLIC)
