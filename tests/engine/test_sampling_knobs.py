"""The sampling knobs beyond temperature and truncation, each against a plain reference.

References are written out here: a teacher-forced forward pass of the demo model gives the
logits each step saw, and the penalty formula (vLLM's ``apply_penalties``), the min-tokens mask
and top-k logprobs are applied to them by hand.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.decoding import RowDecoder
from engine.detokenize import IncrementalText, decode_text
from engine.errors import InvalidRequestError
from engine.generation import Engine, GenerationRequest
from engine.sampling import choice_seed, sample_row
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPT = "User: what is in this photo?"


def next_logits(loaded, token_ids) -> torch.Tensor:
    """The raw fp32 logits after ``token_ids``, from a plain forward pass of one row."""
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([list(token_ids)])).logits[0, -1].float()


def penalized(logits, prompt, output, *, repetition=1.0, frequency=0.0, presence=0.0):
    """vLLM's penalties, one token id at a time."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        if logits[token] > 0:
            logits[token] /= repetition
        else:
            logits[token] *= repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


def only(result):
    assert len(result.choices) == 1
    return result.choices[0]


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=-0.6),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=-0.4),
    dict(presence_penalty=-0.5, frequency_penalty=0.2),
])
def test_greedy_penalties_follow_vllms_formula(engine, loaded, prompts, penalties):
    prompt = prompts.text(PROMPT)
    free = only(engine.generate([GenerationRequest(prompt, GREEDY)])[0])
    choice = only(engine.generate([GenerationRequest(prompt, dataclasses.replace(GREEDY, **penalties))])[0])
    assert choice.token_ids != free.token_ids  # the penalty changes what greedy picks
    names = {"repetition_penalty": "repetition", "frequency_penalty": "frequency", "presence_penalty": "presence"}
    kw = {names[k]: v for k, v in penalties.items()}
    for k, token in enumerate(choice.token_ids):
        raw = next_logits(loaded, prompt + choice.token_ids[:k])
        assert token == int(torch.argmax(penalized(raw, prompt, choice.token_ids[:k], **kw)))
        # The logprob stays that of the raw distribution, not of the penalized one.
        assert choice.logprobs[k] == pytest.approx(float(torch.log_softmax(raw, -1)[token]), abs=1e-4)


def test_sampled_penalties_follow_vllms_formula(engine, loaded, prompts):
    prompt = prompts.text("The weather today is")
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, seed=21,
                            repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=-0.8)
    choice = only(engine.generate([GenerationRequest(prompt, params)])[0])
    generator = torch.Generator().manual_seed(choice_seed(21, 0))
    expected: list[int] = []
    for _ in range(10):
        raw = next_logits(loaded, prompt + expected)
        logits = penalized(raw, prompt, expected, repetition=1.2, frequency=0.4, presence=-0.8)
        expected.append(int(sample_row(logits, params, generator)))
    assert choice.token_ids == expected


def test_min_tokens_masks_eos_and_stop_ids_until_reached(loaded, prompts):
    prompt = prompts.text(PROMPT)
    free = only(Engine(loaded).generate([GenerationRequest(prompt, GREEDY)])[0]).token_ids
    # Pretend the second greedy token is the eos and the fourth a stop id.
    eos, stop = free[1], free[3]
    engine = Engine(dataclasses.replace(loaded, eos_token_ids=(eos,)))
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,), min_tokens=5)
    unmasked = only(engine.generate([GenerationRequest(prompt, dataclasses.replace(params, min_tokens=0))])[0])
    assert unmasked.token_ids == free[:2] and unmasked.matched_stop == eos
    choice = only(engine.generate([GenerationRequest(prompt, params)])[0])
    expected: list[int] = []
    while len(expected) < 12:
        logits = next_logits(loaded, prompt + expected).clone()
        if len(expected) < 5:
            logits[[eos, stop]] = -math.inf
        expected.append(int(torch.argmax(logits)))
        if expected[-1] in (eos, stop):
            break
    assert choice.token_ids == expected
    assert len(choice.token_ids) > 5 and not {eos, stop} & set(choice.token_ids[:5])
    # The same mask holds under ignore_eos (vLLM masks eos for min_tokens either way).
    ignoring = only(engine.generate([GenerationRequest(prompt, dataclasses.replace(params, ignore_eos=True))])[0])
    assert ignoring.token_ids[:5] == expected[:5]


def test_top_logprobs_are_the_raw_distributions_top_k(engine, loaded, prompts):
    prompt = prompts.text("A man is riding")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, top_logprobs=5, repetition_penalty=1.5)
    choice = only(engine.generate([GenerationRequest(prompt, params)])[0])
    assert len(choice.top_logprobs) == len(choice.token_ids) == 6
    for k, step in enumerate(choice.top_logprobs):
        reference = torch.log_softmax(next_logits(loaded, prompt + choice.token_ids[:k]), -1)
        values, ids = torch.topk(reference, 5)
        assert [token for token, _ in step] == ids.tolist()
        torch.testing.assert_close([lp for _, lp in step], values.tolist(), atol=1e-4, rtol=0)
        assert choice.logprobs[k] == pytest.approx(float(reference[choice.token_ids[k]]), abs=1e-4)
    assert only(engine.generate([GenerationRequest(prompt, dataclasses.replace(params, top_logprobs=0))])[0]
                ).top_logprobs is None


def test_prompt_logprobs_are_teacher_forced(engine, loaded, prompts):
    prompt = prompts.text("Mathematics: if x + 2 = 5")
    result = engine.generate([GenerationRequest(prompt, dataclasses.replace(GREEDY, prompt_logprobs=3))])[0]
    with torch.inference_mode():
        reference = torch.log_softmax(loaded.model(input_ids=torch.tensor([prompt])).logits[0].float(), -1)
    assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(result.prompt_top_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        assert result.prompt_logprobs[j] == pytest.approx(float(reference[j - 1, prompt[j]]), abs=1e-4)
        values, ids = torch.topk(reference[j - 1], 3)
        assert [t for t, _ in result.prompt_top_logprobs[j]] == ids.tolist()
    zero = engine.generate([GenerationRequest(prompt, dataclasses.replace(GREEDY, prompt_logprobs=0))])[0]
    assert zero.prompt_logprobs == pytest.approx(result.prompt_logprobs, abs=1e-5)
    assert zero.prompt_top_logprobs is None
    assert engine.generate([GenerationRequest(prompt, GREEDY)])[0].prompt_logprobs is None


def test_stop_strings_cut_the_text_and_keep_the_tokens(engine, loaded, prompts):
    prompt = prompts.text("Code: def f(x):")
    free = only(engine.generate([GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=16))])[0])
    assert free.text == loaded.tokenizer.decode(free.token_ids)
    # A stop string that starts inside one token and ends inside the next (both whole characters).
    pieces = [loaded.tokenizer.decode([t]) for t in free.token_ids]
    k = next(k for k in range(1, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2
             and "\ufffd" not in pieces[k] + pieces[k + 1])
    stop = pieces[k][-1] + pieces[k + 1][:2]
    index = free.text.index(stop)
    ends_in = next(j for j in range(len(pieces)) if len(loaded.tokenizer.decode(free.token_ids[: j + 1])) >= index + len(stop))
    assert index + len(stop) > len(loaded.tokenizer.decode(free.token_ids[:ends_in]))

    trimmed, kept = engine.generate([
        GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=16, stop=("zzz-never", stop))),
        GenerationRequest(prompt, dataclasses.replace(GREEDY, max_tokens=16, stop=(stop,),
                                                      include_stop_str_in_output=True)),
    ])
    for choice in (trimmed.choices[0], kept.choices[0]):
        assert choice.finish_reason == "stop" and choice.matched_stop == stop
        assert choice.token_ids == free.token_ids[:ends_in + 1]
        assert len(choice.logprobs) == len(choice.token_ids)
    assert trimmed.choices[0].text == free.text[:index]
    assert kept.choices[0].text == free.text[:index + len(stop)]


def test_stop_token_text_is_trimmed_unless_asked(loaded, prompts):
    prompt = prompts.text(PROMPT)
    free = only(Engine(loaded).generate([GenerationRequest(prompt, GREEDY)])[0]).token_ids
    stop = free[3]
    engine = Engine(loaded)
    trimmed, kept = engine.generate([
        GenerationRequest(prompt, dataclasses.replace(GREEDY, stop_token_ids=(stop,))),
        GenerationRequest(prompt, dataclasses.replace(GREEDY, stop_token_ids=(stop,), include_stop_str_in_output=True)),
    ])
    assert trimmed.choices[0].matched_stop == stop and trimmed.choices[0].token_ids == free[:4]
    assert trimmed.choices[0].text == loaded.tokenizer.decode(free[:3])
    assert kept.choices[0].text == loaded.tokenizer.decode(free[:4])


def test_incremental_text_never_shows_half_a_character(loaded):
    tokenizer = loaded.tokenizer
    text = "héllo wörld 猫 🐱 The end"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # characters really are split
    stream = IncrementalText(tokenizer)
    for k, token in enumerate(ids):
        stream.push(token)
        assert "\ufffd" not in stream.text
        assert tokenizer.decode(ids[: k + 1]).startswith(stream.text)
    assert stream.text == stream.finish() == text
    cut = IncrementalText(tokenizer)
    for token in ids[: ids.index(ids[-1]) - 6]:
        cut.push(token)
    assert cut.finish() == tokenizer.decode(ids[: ids.index(ids[-1]) - 6])


def test_text_that_ends_in_a_broken_character_is_still_decoded_in_linear_work(loaded):
    """Stray byte tokens (continuation bytes with no lead byte) decode to U+FFFD that no later token
    completes: the open window must not grow with the output (it was decoded whole at every step:
    4,000 tokens took 1.44 s against 0.02 s), and the text stays the whole decode's."""
    tokenizer = loaded.tokenizer
    cat = tokenizer("猫", add_special_tokens=False)["input_ids"]
    assert len(cat) == 3  # three byte tokens: its last is a continuation byte
    stray = cat[-1]
    letters = tokenizer("ab", add_special_tokens=False)["input_ids"]
    ids = ([stray] * 5 + letters) * 200 + [stray] * 1000
    decoded = [0]
    real_decode = tokenizer.decode

    def counting_decode(token_ids, **kwargs):
        decoded[0] += len(token_ids)
        return real_decode(token_ids, **kwargs)

    stream = IncrementalText(tokenizer)
    tokenizer.decode = counting_decode
    try:
        for k, token in enumerate(ids):
            stream.push(token)
            if k % 97 == 0:
                assert real_decode(ids[: k + 1]).startswith(stream.text)
    finally:
        del tokenizer.decode
    assert decoded[0] < 40 * len(ids)  # a window of ~12 tokens, decoded twice a step (was ~n^2 / 2)
    assert stream.finish() == real_decode(ids) and stream.text.count("ab") == 200


def row(loaded, **params):
    return RowDecoder(0, 0, SamplingParams(max_tokens=64, temperature=0, **params), None,
                      eos_token_ids=frozenset(loaded.eos_token_ids), tokenizer=loaded.tokenizer)


def test_a_multibyte_stop_string_matches_only_once_the_character_is_whole(loaded):
    tokenizer = loaded.tokenizer
    ids = tokenizer("héllo 猫 world", add_special_tokens=False)["input_ids"]
    cat = tokenizer("猫", add_special_tokens=False)["input_ids"]
    decoder = row(loaded, stop=("猫",))
    for token in ids:
        decoder.record(token, aborted=False)
        if decoder.done:
            break
    end = next(k for k in range(len(ids)) if "猫" in tokenizer.decode(ids[: k + 1]))
    assert len(cat) == 3 and decoder.token_ids == ids[: end + 1]
    assert (decoder.finish_reason, decoder.matched_stop, decoder.text()) == ("stop", "猫", "héllo ")


def test_stop_strings_wait_for_min_tokens(loaded):
    tokenizer = loaded.tokenizer
    ids = tokenizer("Yes. No. Yes. No.", add_special_tokens=False)["input_ids"]
    decoder = row(loaded, stop=("No",), min_tokens=4)
    for token in ids:
        decoder.record(token, aborted=False)
        if decoder.done:
            break
    # The first "No" lies within the first four tokens: only the second one stops the row.
    assert len(tokenizer.decode(ids[:4])) > len("Yes. No")
    assert decoder.text() == "Yes. No. Yes. "


def test_special_tokens_in_the_text(loaded):
    tokenizer = loaded.tokenizer
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    ids = [start, *tokenizer("user", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    for skip, expected in ((True, "user"), (False, "<|im_start|>user<|im_end|>")):
        for spaces in (True, False):
            decoder = row(loaded, skip_special_tokens=skip, spaces_between_special_tokens=spaces, ignore_eos=True)
            for token in ids:
                decoder.record(token, aborted=False)
            assert decoder.text() == expected


def test_spaces_between_special_tokens_false_joins_added_tokens_tightly():
    # A WordPiece decoder joins words with spaces, the special tokens included: exactly what
    # spaces_between_special_tokens=False must take away.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]",
                                        sep_token="[SEP]")
    ids = [1, 3, 4, 5, 2]
    assert decode_text(tokenizer, ids, skip_special_tokens=False) == "[CLS] hello worlds [SEP]"
    assert decode_text(tokenizer, ids, skip_special_tokens=False,
                       spaces_between_special_tokens=False) == "[CLS]hello worlds[SEP]"
    assert decode_text(tokenizer, ids, skip_special_tokens=True, spaces_between_special_tokens=False) == "hello worlds"
    stream = IncrementalText(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False)
    for token in ids:
        stream.push(token)
    assert stream.finish() == "[CLS]hello worlds[SEP]"


def test_detokenize_false_returns_no_text(engine, prompts):
    result = engine.generate([GenerationRequest(prompts.text("Yes."), dataclasses.replace(GREEDY, detokenize=False))])
    assert only(result[0]).text is None


KNOBBED = SamplingParams(max_tokens=10, temperature=0.9, seed=5, min_tokens=3, stop=("e",), top_logprobs=4,
                         prompt_logprobs=2, repetition_penalty=1.2, frequency_penalty=0.2, presence_penalty=-0.3)


def test_knobs_give_the_same_result_alone_and_in_a_batch(engine, prompts):
    image = prompts.image_features()
    knobbed = GenerationRequest(prompts.text("The quick brown fox"), dataclasses.replace(KNOBBED, n=2))
    batch = [
        GenerationRequest(prompts.text("The image shows a kitchen with a wooden table, two chairs, a window and"),
                          GREEDY),
        knobbed,
        GenerationRequest(prompts.image_prompt("Describe the image.", image),
                          dataclasses.replace(KNOBBED, seed=6, stop=()), mm_kwargs=image),
    ]
    together = engine.generate(batch)
    for request, batched in zip(batch, together, strict=True):
        alone = engine.generate([request])[0]
        for a, b in zip(alone.choices, batched.choices, strict=True):
            assert (a.token_ids, a.text, a.finish_reason, a.matched_stop) == (
                b.token_ids, b.text, b.finish_reason, b.matched_stop)
            if a.top_logprobs is not None:
                assert [[t for t, _ in s] for s in a.top_logprobs] == [[t for t, _ in s] for s in b.top_logprobs]
        if alone.prompt_logprobs is not None:
            torch.testing.assert_close(alone.prompt_logprobs[1:], batched.prompt_logprobs[1:], atol=1e-5, rtol=0)
    assert together[2].prompt_logprobs is not None and together[0].prompt_logprobs is None


@pytest.mark.parametrize("bad", [
    dict(min_tokens=-1), dict(min_tokens=20), dict(stop=("",)), dict(stop=("a",) * 17), dict(stop=(3,)),
    dict(repetition_penalty=0.0), dict(repetition_penalty=float("nan")), dict(frequency_penalty=2.5),
    dict(presence_penalty=-3.0), dict(top_logprobs=21), dict(top_logprobs=-1), dict(prompt_logprobs=-1),
    dict(prompt_logprobs=True), dict(skip_special_tokens=1), dict(spaces_between_special_tokens="no"),
    dict(include_stop_str_in_output=None), dict(detokenize=False, stop=("x",)),
])
def test_new_sampling_params_are_validated(bad):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=16, **bad)
    assert set(info.value.errors) == set(bad) - {"detokenize"}


def test_stop_strings_need_a_tokenizer(loaded, prompts):
    engine = Engine(dataclasses.replace(loaded, tokenizer=None))
    with pytest.raises(InvalidRequestError) as info:
        engine.generate([GenerationRequest(prompts.text("Yes."), dataclasses.replace(GREEDY, stop=("x",)))])
    assert set(info.value.errors) == {"stop"}
    assert only(engine.generate([GenerationRequest(prompts.text("Yes."), GREEDY)])[0]).text is None


@pytest.mark.gpu
def test_knobs_on_cuda_match_alone_batched_and_cpu(demo_model_dir, engine, prompts):
    from engine.loading import load_model

    cuda = Engine(load_model(str(demo_model_dir), device="cuda"))
    greedy_knobs = dataclasses.replace(KNOBBED, temperature=0, n=1)
    batch = [GenerationRequest(prompts.text("The quick brown fox"), greedy_knobs),
             GenerationRequest(prompts.text("Yes."), dataclasses.replace(KNOBBED, n=2))]
    together = cuda.generate(batch)
    assert [c.token_ids for c in cuda.generate(batch[:1])[0].choices] == [c.token_ids for c in together[0].choices]
    on_cpu = engine.generate(batch[:1])[0]
    # fp32 on both: greedy with penalties picks the same tokens unless a near-tie flips.
    assert together[0].choices[0].token_ids == on_cpu.choices[0].token_ids
    torch.testing.assert_close(together[0].prompt_logprobs[1:], on_cpu.prompt_logprobs[1:], atol=1e-3, rtol=0)
    assert len(together[1].choices[1].top_logprobs) == len(together[1].choices[1].token_ids)


@pytest.mark.parametrize("knobs", [
    {"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 5e-324}, {"temperature": 9e-6},
    {"top_p": 1e-300}, {"top_p": 5e-324},
    {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e-300, "temperature": 1e-3},
    {"frequency_penalty": 2.0, "presence_penalty": 2.0, "repetition_penalty": 1e-40, "top_p": 1e-300},
])
def test_tiny_sampling_values_never_reach_the_draw_as_nan(engine, prompts, knobs):
    """Values that pass validation but overflow fp32 (a temperature of 1e-300, a top_p fp32 reads as
    0, a repetition penalty of 1e-300) sample a token: below 1e-5 the temperature is greedy (as in
    vLLM and SGLang), a tiny top_p keeps the most likely token, penalties are floored."""
    prompt = prompts.text("The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(max_tokens=6, seed=3, ignore_eos=True, **knobs)
    [result] = engine.generate([GenerationRequest(prompt, params)])
    choice = result.choices[0]
    assert len(choice.token_ids) == 6 and all(math.isfinite(lp) for lp in choice.logprobs)
    if knobs.keys() <= {"temperature", "top_p"}:
        greedy = engine.generate([GenerationRequest(prompt, SamplingParams(max_tokens=6, temperature=0,
                                                                           ignore_eos=True))])[0]
        assert choice.token_ids == greedy.choices[0].token_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_media_placeholder_is_never_sampled_and_logprobs_stay_raw(demo_model_dir, prompts, temperature):
    """A placeholder id fed back (the next turn, a scoring call) would be taken for a media slot: even
    a model that favours one never emits it, and the logprobs reported are the raw distribution's."""
    from engine.loading import load_model
    from engine.scoring import ScoreRequest

    loaded = load_model(str(demo_model_dir), device="cpu")
    pad = loaded.media_token_ids["image"]
    forward = loaded.model.forward

    def favouring_the_pad(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[..., pad] += 50.0
        return out

    loaded.model.forward = favouring_the_pad
    engine = Engine(loaded)
    prompt = prompts.text("The quick brown fox")
    params = SamplingParams(max_tokens=5, temperature=temperature, seed=1, ignore_eos=True, top_logprobs=1)
    [result] = engine.generate([GenerationRequest(prompt, params)])
    choice = result.choices[0]
    assert pad not in choice.token_ids and len(choice.token_ids) == 5
    assert all(step[0][0] == pad for step in choice.top_logprobs)  # the raw distribution's top is the pad
    scored = engine.score([ScoreRequest(prompt, choice.token_ids)])[0].logprobs
    torch.testing.assert_close(choice.logprobs, scored, atol=1e-4, rtol=0)
