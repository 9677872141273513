"""``python -m tests.e2e.perturbed_gpu_worker``: a GPU worker whose model's teacher-forced logits are
shifted (its scoring path disagrees with its own forward, as a model the engine misreads would),
started as ``rollout-queue worker gpu`` is."""

from __future__ import annotations

import sys

import torch

import engine.loading
from launcher.cli import main

_load_model = engine.loading.load_model


def _perturbed_load_model(*args, **kwargs):
    loaded = _load_model(*args, **kwargs)
    forward = loaded.model.forward

    def shifted(*f_args, **f_kwargs):
        out = forward(*f_args, **f_kwargs)
        if f_kwargs.get("use_cache") is False:  # teacher-forced scoring only
            out.logits = out.logits + torch.linspace(0, 2, out.logits.shape[-1])
        return out

    loaded.model.forward = shifted
    return loaded


engine.loading.load_model = _perturbed_load_model

if __name__ == "__main__":
    sys.exit(main(["worker", "gpu"]))
