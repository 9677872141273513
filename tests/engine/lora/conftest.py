"""LoRA fixtures: random PEFT adapters made by peft itself on the demo model, and PEFT's own
forward as the reference (tests/fidelity.py's ``Reference`` with a ``PeftModel`` in it)."""

from __future__ import annotations

import pytest

from tests.engine.lora.lora_support import make_adapter


@pytest.fixture(scope="session")
def adapters_root(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="session")
def adapter_a(demo_model_dir, adapters_root):
    """Rank 4 on every projection of the language model."""
    return make_adapter(demo_model_dir, adapters_root / "a", rank=4, alpha=8, seed=1)


@pytest.fixture(scope="session")
def adapter_b(demo_model_dir, adapters_root):
    """Rank 2 with rsLoRA's scale on the attention projections and the output head."""
    return make_adapter(demo_model_dir, adapters_root / "b", rank=2, alpha=4, seed=2, use_rslora=True,
                        suffixes=("q_proj", "v_proj", "o_proj"), head=True)
