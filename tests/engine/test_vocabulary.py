"""Token ids outside the model's vocabulary are refused per request, before any tensor is built."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from engine.errors import Fault, TokenIdOutOfRangeError
from engine.generation import GenerationRequest
from engine.sampling_params import SamplingParams
from engine.scoring import ScoreRequest

GREEDY = SamplingParams(max_tokens=2, temperature=0)


@contextmanager
def embedding_calls(loaded):
    """The calls the model's input embedding got meanwhile (it is where a bad id would land)."""
    calls = []
    handle = loaded.model.get_input_embeddings().register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_vocab_size_is_the_embeddings(loaded):
    assert loaded.vocab_size == loaded.model.get_input_embeddings().num_embeddings == 640


@pytest.mark.parametrize("bad", ["vocab", "negative", "huge", "float", "bool"])
def test_score_refuses_a_completion_id_outside_the_vocabulary(engine, loaded, prompts, bad):
    token = {"vocab": loaded.vocab_size, "negative": -1, "huge": 2**40, "float": 7.0, "bool": True}[bad]
    good = ScoreRequest(prompts.text("Hi there"), prompts.text(" friend"))
    with embedding_calls(loaded) as calls, pytest.raises(TokenIdOutOfRangeError) as info:
        engine.score([good, ScoreRequest(prompts.text("Hi"), [9, 10, token])])
    assert calls == []  # nothing ran: the check comes before the batch is built
    error = info.value
    assert (error.code, error.fault) == ("token_id_out_of_range", Fault.INVALID)
    assert error.errors == {"field": "completion_token_ids", "index": 2, "vocab_size": loaded.vocab_size}


def test_generate_and_score_refuse_a_prompt_id_outside_the_vocabulary(engine, loaded, prompts):
    bad_prompt = [*prompts.text("Hi"), loaded.vocab_size + 3]
    with embedding_calls(loaded) as calls:
        with pytest.raises(TokenIdOutOfRangeError) as info:
            engine.generate([GenerationRequest(prompts.text("fine"), GREEDY), GenerationRequest(bad_prompt, GREEDY)])
        assert info.value.errors["field"] == "prompt_token_ids" and info.value.errors["index"] == len(bad_prompt) - 1
        with pytest.raises(TokenIdOutOfRangeError):
            engine.score([ScoreRequest(bad_prompt, [9])])
    assert calls == []
    # The highest ids are fine (the last ones are media placeholders, as in real Qwen tokenizers:
    # the highest text id is taken).
    last = max(set(range(loaded.vocab_size)) - set(loaded.media_token_ids.values()))
    assert last >= loaded.vocab_size - len(loaded.media_token_ids) - 1
    assert engine.score([ScoreRequest([*prompts.text("Hi"), last], [last])])


@pytest.mark.parametrize(("ids", "index"), [
    ([1, 2, 3], None), ((1, 2), None), ([], None), ([0, 9], None),
    ([1, 10], 1), ([-1, 2], 0), ([1, True], 1), ([1, 2.0], 1), ([1, "2"], 1), ([3, None, 4], 1),
])
def test_the_first_id_outside_the_vocabulary_is_named(ids, index):
    from engine.errors import TokenIdOutOfRangeError, check_token_ids

    if index is None:
        check_token_ids(ids, 10, "token_ids")
        return
    with pytest.raises(TokenIdOutOfRangeError) as refused:
        check_token_ids(ids, 10, "token_ids")
    assert (refused.value.field, refused.value.index) == ("token_ids", index)
