"""What the API knows of a model from its config alone (workers.models.ModelFacts) agrees with the
model's processor, for every demo architecture: the API never loads the processor."""

from __future__ import annotations

import pytest

from engine.demo_model import ARCHS
from workers.models import model_facts


@pytest.mark.parametrize("arch", ARCHS)
def test_config_facts_match_the_processor(arch, model_dirs, processors):
    facts, processor = model_facts(str(model_dirs[arch])), processors[arch]
    expected = processor.image_token_id if "image" in processor.modalities else None
    assert facts.image_token_id == expected
    assert facts.vocab_size >= len(processor.tokenizer)
