"""What the API knows of a model from its config alone (domain.models.ModelFacts) and the tokenizer
it loads without torch (domain.model_probe) agree with the model's processor, for every demo
architecture: the API never loads the processor."""

from __future__ import annotations

import pytest

from domain.model_probe import load_tokenizer, probe_here
from domain.models import model_facts
from engine.demo_model import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_config_facts_match_the_processor(arch, model_dirs, processors):
    facts, processor = model_facts(str(model_dirs[arch])), processors[arch]
    expected = processor.image_token_id if "image" in processor.modalities else None
    assert facts.image_token_id == expected
    assert facts.vocab_size >= len(processor.tokenizer)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_apis_tokenizer_is_the_processors(arch, model_dirs, processors):
    found = probe_here(str(model_dirs[arch]))
    tokenizer, expected = load_tokenizer(str(model_dirs[arch]), found.tokenizer_class), processors[arch].tokenizer
    assert type(tokenizer) is type(expected)
    text = "Hello, world: ünïcode <|im_start|> 12345"
    assert tokenizer(text)["input_ids"] == expected(text)["input_ids"]
