"""Structured outputs on the demo model (engine/grammar/): what a constrained row samples obeys
its constraint by construction, ends within a few hundred tokens, and leaves the model's raw
logprobs as they were; the sampling mask and processed logprobs carry the constraint."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from types import SimpleNamespace

import jsonschema
import pytest
import torch
import xgrammar as xgr

from engine.generation import GenerationRequest
from engine.grammar.compiler import PendingGrammar, model_grammars
from engine.grammar.errors import GrammarTooComplexError, InvalidGrammarError
from engine.grammar.for_request import admissible
from engine.grammar.spec import MAX_GRAMMAR_CHARS, GrammarSpec
from engine.sampling_mask import unpack
from engine.sampling_params import SamplingParams
from tests.fidelity import Reference, assert_close

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "colour", "count", "tags"],
    "additionalProperties": False,
}
SEEDS = range(24)


def run(engine, prompts, structured_output, *, seeds=SEEDS, **params):
    prompt = prompts.text("Describe the image in one sentence.")
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=300, seed=seed, structured_output=structured_output,
                                                         **params)) for seed in seeds]
    return prompt, [result.choices[0] for result in engine.generate(requests)]


def grammar_text(engine, token_ids: list[int]) -> str:
    """The characters the grammar matched: the tokens' bytes (without the final stop token).

    xgrammar takes a UTF-8-encoded surrogate (ED A0..BF xx) for one character, as a random model
    strings byte tokens together; the tokenizer's text shows it as three U+FFFD (a trained
    model does not sample them). ``surrogatepass`` reads it as the grammar counted it."""
    vocab = xgr.TokenizerInfo.from_huggingface(engine.loaded.tokenizer).decoded_vocab
    raw = b"".join(vocab[t] for t in token_ids[:-1])
    return raw.decode("utf-8", "surrogatepass")


def test_a_json_schema_output_parses_and_validates_for_every_seed(engine, prompts):
    _, choices = run(engine, prompts, {"json_schema": SCHEMA})
    for choice in choices:
        assert choice.finish_reason == "stop", choice.text
        assert choice.token_ids[-1] in engine.loaded.eos_token_ids
        text = grammar_text(engine, choice.token_ids)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert json.loads(choice.text)  # the tokenizer's text is JSON too
        assert len(choice.token_ids) < 200


def test_json_object_is_an_object_without_free_whitespace(engine, prompts):
    _, choices = run(engine, prompts, {"json_object": True})
    ended = [choice for choice in choices if choice.finish_reason == "stop"]
    assert len(ended) >= len(choices) // 2  # a random model closes its strings at random, not never
    for choice in ended:
        assert isinstance(json.loads(choice.text), dict)
        assert "\n" not in choice.text and "  " not in choice.text.replace('": ', "").replace('", ', "")


def test_a_regex_and_a_choice(engine, prompts):
    _, choices = run(engine, prompts, {"regex": r"[a-z]{2,5}-[0-9]{3}"})
    assert all(re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", c.text) and c.finish_reason == "stop" for c in choices)
    options = ["yes", "no", "it depends"]
    _, choices = run(engine, prompts, {"choice": options})
    assert all(c.text in options and c.finish_reason == "stop" for c in choices)
    assert len({c.text for c in choices}) > 1  # sampled, not forced to one


def test_the_grammar_ends_the_row_under_ignore_eos_and_min_tokens(engine, prompts):
    for params in ({"ignore_eos": True}, {"min_tokens": 50}, {"temperature": 0}):
        _, choices = run(engine, prompts, {"choice": ["yes", "no"]}, seeds=range(4), **params)
        assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in choices), params


def allowed_ids(tokenizer, vocab_size, eos, spec: dict, tokens: list[int]) -> list[set[int]]:
    """Each step's grammar-allowed ids, replayed on a fresh matcher from xgrammar itself."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos))
    compiled = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(
        json.dumps(spec), any_whitespace=False)
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab_size)
    steps = []
    for token in tokens:
        matcher.fill_next_token_bitmask(bitmask)
        bits = ((bitmask[0][:, None] >> torch.arange(32)) & 1).flatten()[:vocab_size]
        steps.append(set(torch.nonzero(bits)[:, 0].tolist()))
        assert matcher.accept_token(token)
    return steps


def test_the_processed_mask_holds_only_grammar_tokens_and_raw_logprobs_stay_the_models(engine, prompts,
                                                                                      demo_model_dir):
    loaded = engine.loaded
    prompt, choices = run(engine, prompts, {"json_schema": SCHEMA}, seeds=range(3), sampling_mask=True,
                          logprobs_mode="processed", top_k=50)
    _, raw = run(engine, prompts, {"json_schema": SCHEMA}, seeds=range(3), top_k=50)
    reference = Reference(demo_model_dir, None)
    for choice, raw_choice in zip(choices, raw, strict=True):
        assert choice.token_ids == raw_choice.token_ids  # the mask and the mode change no draw
        allowed = allowed_ids(prompts.tokenizer, loaded.vocab_size, loaded.eos_token_ids, SCHEMA, choice.token_ids)
        mask = unpack(choice.sampling_mask)
        ids, offsets = mask["token_ids"], mask["offsets"]
        for step, (token, grammar) in enumerate(zip(choice.token_ids, allowed, strict=True)):
            support = set(ids[offsets[step]:offsets[step + 1]])
            assert token in support and support <= grammar, step
        # processed: each token's logprob under the constrained distribution; raw: the model's own.
        assert all(p <= 0 for p in choice.logprobs)
        want = reference.token_logprobs(prompt, raw_choice.token_ids)
        assert_close(raw_choice.logprobs, want, "constrained rows' raw logprobs")


def test_a_free_row_samples_as_alone_beside_constrained_ones(engine, prompts):
    prompt = prompts.text("The quick brown fox")
    free = SamplingParams(max_tokens=12, seed=5, ignore_eos=True)
    alone = engine.generate([GenerationRequest(prompt, free)])[0].choices[0]
    mixed = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=40, seed=1,
                                                                      structured_output={"regex": "[0-9]{8}"})),
                             GenerationRequest(prompt, free)])
    assert mixed[1].choices[0].token_ids == alone.token_ids
    assert mixed[1].choices[0].logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert re.fullmatch("[0-9]{8}", mixed[0].choices[0].text)


@pytest.mark.parametrize(("structured_output", "error"), [
    ({"regex": "("}, InvalidGrammarError),
    ({"json_schema": {"type": "no-such-type"}}, InvalidGrammarError),
    ({"grammar": 'root ::= undefined_rule'}, InvalidGrammarError),
])
def test_a_constraint_that_does_not_compile_is_a_typed_refusal(engine, prompts, structured_output, error):
    with pytest.raises(error) as raised:
        engine.generate([GenerationRequest(prompts.text("Yes"), SamplingParams(structured_output=structured_output))])
    assert raised.value.code == "invalid_grammar" and "structured_output" in raised.value.errors


@pytest.mark.parametrize(("structured_output", "code"), [
    ({"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "grammar_too_complex"),
    ({"choice": []}, "invalid_grammar"),
    ({"json_object": False}, "invalid_grammar"),
    ({"regex": "a", "choice": ["a"]}, "invalid_grammar"),
    ({"json_schema": "not an object"}, "invalid_grammar"),
])
def test_a_malformed_or_oversized_constraint_is_refused_before_any_compile(structured_output, code):
    with pytest.raises((InvalidGrammarError, GrammarTooComplexError)) as raised:
        SamplingParams(structured_output=structured_output)
    assert raised.value.code == code


def test_a_grammar_not_compiled_by_its_deadline_ends_its_job_alone():
    never = PendingGrammar(GrammarSpec("regex", "a+"), Future(), timeout_s=0.0)
    slow, free = SimpleNamespace(grammar=never, error=None), SimpleNamespace(grammar=None, error=None)
    failed = []

    def fail(job, error):
        job.error = error
        failed.append((job, error))

    assert admissible([slow, free], fail) == [free]
    [(job, error)] = failed
    assert job is slow and isinstance(error, GrammarTooComplexError) and error.code == "grammar_too_complex"


def test_a_compiling_grammar_holds_back_its_job_only(engine):
    loaded = engine.loaded
    waiting = PendingGrammar(GrammarSpec("regex", "a+"), Future(), timeout_s=60.0)
    job, free = SimpleNamespace(grammar=waiting, error=None), SimpleNamespace(grammar=None, error=None)
    assert admissible([job, free], lambda *_: pytest.fail("nothing fails")) == [free]
    grammars = model_grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    spec = GrammarSpec.from_request({"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}})
    first = grammars.compile(spec)
    assert grammars.start(spec).poll() is first  # the cache: no second compile


@pytest.mark.gpu
def test_constrained_rows_on_cuda_obey_their_schema(demo_model_dir):
    """The bitmask applied on the device (xgrammar's CUDA kernel), beside a free row."""
    from engine.generation import Engine
    from engine.loading import load_model

    engine = Engine(load_model(str(demo_model_dir), device="cuda"))
    prompt = engine.loaded.tokenizer("Describe the image.", add_special_tokens=False)["input_ids"]
    requests = [GenerationRequest(prompt, SamplingParams(max_tokens=300, seed=seed,
                                                         structured_output={"json_schema": SCHEMA}))
                for seed in range(8)] + [GenerationRequest(prompt, SamplingParams(max_tokens=8, seed=1))]
    results = engine.generate(requests)
    for result in results[:-1]:
        choice = result.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(grammar_text(engine, choice.token_ids)), SCHEMA)
    assert len(results[-1].choices[0].token_ids) >= 1


def test_an_idle_scheduler_waits_on_a_compile_rather_than_spinning():
    import threading

    from engine.grammar.for_request import wait_for_grammars

    def compiling(after_s: float) -> SimpleNamespace:
        future = Future()
        threading.Timer(after_s, future.set_result, args=("compiled",)).start()
        return SimpleNamespace(grammar=PendingGrammar(GrammarSpec("regex", "a+"), future, timeout_s=60.0))

    job = compiling(0.05)
    wait_for_grammars([job], timeout_s=30)  # nothing else to do: back when the compile ends
    assert job.grammar.future.done()
    job = compiling(5.0)
    wait_for_grammars([job, SimpleNamespace(grammar=None)], timeout_s=30)  # a free job waits: no wait
    assert not job.grammar.future.done()
