"""Placeholder normalisation (text) and expansion (tokens), and every way they can mismatch."""

from __future__ import annotations

import pytest

from engine.demo_model import ARCHS
from engine.errors import Fault, PlaceholderMismatchError
from processors.errors import PlaceholderCountError
from processors.pipeline import preprocess
from processors.placeholders import IMAGE_SENTINEL, expand_tokens, media_pattern, normalize_media

QWEN = "<|vision_start|><|image_pad|><|vision_end|>"
P, START, END = 9, 7, 8  # image pad, vision start, vision end (made-up ids)


def expand(ids, replacements, placeholder_ids=(P,), collapsed=P):
    return expand_tokens(ids, replacements, placeholder_ids=frozenset(placeholder_ids), collapsed_id=collapsed)


# --- text ---------------------------------------------------------------------------------------


def _image_forms(native: str) -> dict[str, str]:
    return {IMAGE_SENTINEL: native, native: native}


def test_sentinel_and_native_forms_normalise_in_one_counted_pass():
    forms = _image_forms(QWEN)
    text, count = normalize_media(f"a <image> b {QWEN} c<image>", media_pattern(forms), forms)
    assert (text, count) == (f"a {QWEN} b {QWEN} c{QWEN}", 3)
    # Regression: the native form is never rewritten again, so normalising twice changes nothing.
    assert normalize_media(text, media_pattern(forms), forms) == (text, 3)


def test_sentinel_is_the_native_form_for_llava():
    forms = _image_forms("<image>")
    assert normalize_media("<image>\n<image> hi", media_pattern(forms), forms) == ("<image>\n<image> hi", 2)


def test_sentinel_prompt_matches_native_prompt(processors, fetcher, transport, limits, image_url):
    processor = processors["qwen2_vl"]
    parts = [{"type": "image_url", "url": image_url()}]

    def run(prompt):
        return preprocess({"prompt": prompt, "content_parts": parts}, processor=processor, fetcher=fetcher,
                          cache=None, transport=transport, limits=limits)

    sentinel, native = run("Describe <image> briefly."), run(f"Describe {QWEN} briefly.")
    assert sentinel.prompt_token_ids == native.prompt_token_ids
    offset = native.prompt_token_ids.index(processor.image_token_id)
    assert sentinel.placeholder_ranges == native.placeholder_ranges == [
        {"modality": "image", "offset": offset, "length": 4}]
    assert sentinel.prompt_token_ids.count(processor.image_token_id) == 4


# --- tokens -------------------------------------------------------------------------------------


def test_collapsed_expanded_and_mixed_token_ids_expand_alike():
    replacements = [[P, P, P], [P, P]]
    want = ([1, P, P, P, 2, P, P, 3], [(1, 4), (5, 7)])
    assert expand([1, P, 2, P, 3], replacements) == want
    assert expand([1, P, P, P, 2, P, P, 3], replacements) == want  # never expanded twice
    assert expand([1, P, 2, P, P, 3], replacements) == want
    # Adjacent collapsed placeholders in one run are one image each.
    assert expand([P, P], replacements) == ([P] * 5, [(0, 3), (3, 5)])


def test_native_triple_keeps_its_frame():
    ids, offsets = expand([START, P, END, 5, START, P, END], [[P] * 4, [P] * 2])
    assert ids == [START, P, P, P, P, END, 5, START, P, P, END]
    assert offsets == [(1, 5), (8, 10)]


def test_layouts_with_breaks_match_whole_or_collapsed():
    img, brk, end = 5, 6, 7
    layout = [img, img, brk, img, img, end]
    kw = {"placeholder_ids": (img, brk, end), "collapsed": img}
    assert expand([1, img, 2], [layout], **kw) == ([1, *layout, 2], [(1, 7)])
    assert expand([1, *layout, 2], [layout], **kw) == ([1, *layout, 2], [(1, 7)])
    with pytest.raises(PlaceholderCountError):
        expand([1, brk, img, 2], [layout], **kw)  # a run that starts like no image


@pytest.mark.parametrize(
    ("ids", "placeholders", "items"),
    [
        ([1, P, 2], 1, 2),  # too few
        ([P, 2, P, 3, P], 3, 2),  # too many
        ([1, 2, 3], 0, 2),  # none
    ],
)
def test_count_mismatch_raises_the_internal_error_with_both_counts(ids, placeholders, items):
    with pytest.raises(PlaceholderCountError) as caught:
        expand(ids, [[P, P, P], [P, P]])
    assert (caught.value.placeholders, caught.value.items) == (placeholders, items)


def test_wrong_length_run_is_a_mismatch():
    with pytest.raises(PlaceholderCountError):
        expand([START, P, P, END], [[P, P, P]])


# --- through the pipeline -------------------------------------------------------------------------


@pytest.fixture
def qwen_run(processors, fetcher, transport, limits, image_url):
    processor = processors["qwen2_vl"]
    parts = [{"type": "image_url", "url": image_url(64, 48, 1)}, {"type": "image_url", "url": image_url(64, 48, 2)}]

    def run(**request):
        request.setdefault("content_parts", parts)
        return preprocess(request, processor=processor, fetcher=fetcher, cache=None, transport=transport,
                          limits=limits)

    run.processor = processor
    return run


def ids_of(processor, text):
    return processor.tokenizer(text)["input_ids"]


@pytest.mark.parametrize(
    ("prompt", "placeholders"),
    [(f"one {QWEN} only", 1), (f"{QWEN}{QWEN} and <image>", 3), ("none at all", 0)],
)
def test_token_prompt_mismatch_is_a_422_with_both_counts(qwen_run, prompt, placeholders):
    with pytest.raises(PlaceholderMismatchError) as caught:
        qwen_run(token_ids=ids_of(qwen_run.processor, prompt.replace("<image>", QWEN)))
    error = caught.value
    assert (error.placeholders, error.items, error.fault) == (placeholders, 2, Fault.INVALID)
    assert error.to_dict()["errors"] == {"placeholders": placeholders, "items": 2}


def test_token_prompt_with_a_wrongly_expanded_run_is_a_422(qwen_run):
    ids = ids_of(qwen_run.processor, f"{QWEN} and {QWEN}")
    pad = qwen_run.processor.image_token_id
    ids.insert(ids.index(pad), pad)  # two pads where the image needs four
    with pytest.raises(PlaceholderMismatchError):
        qwen_run(token_ids=ids)


def test_text_prompt_mismatch_the_hf_processor_cannot_fix_is_a_422(qwen_run):
    with pytest.raises(PlaceholderMismatchError) as caught:
        qwen_run(prompt="just <image> here")
    assert (caught.value.placeholders, caught.value.items) == (1, 2)
    assert "1 media placeholders for 2 media items" in caught.value.message


def test_text_prompt_mismatch_falls_back_to_the_hf_processor(qwen_run):
    # Bare <|image_pad|> is no sentinel and no native triple, so the fast path counts 0; the HF
    # processor counts image tokens and places both images (without a vision frame: as written).
    prompt = "left <|image_pad|> right <|image_pad|>"
    fallback = qwen_run(prompt=prompt)
    assert [r["length"] for r in fallback.placeholder_ranges] == [4, 4]
    # The token path over the same tokens (collapsed pads) agrees exactly.
    assert qwen_run(token_ids=ids_of(qwen_run.processor, prompt)).prompt_token_ids == fallback.prompt_token_ids


def test_sentinel_without_media_is_text_for_the_authoritative_path(qwen_run):
    # The fast path counts one image and there are none; the HF processor, which decides,
    # sees no image token in the prompt: the sentinel is plain text.
    result = qwen_run(prompt="what is <image>?", content_parts=[])
    assert result.items == [] and result.placeholder_ranges == []
    assert result.prompt_token_ids == ids_of(qwen_run.processor, "what is <image>?")


@pytest.mark.parametrize("arch", ARCHS)
def test_a_text_prompt_holding_an_expanded_run_is_told_so(arch, processors, fetcher, transport, limits):
    """A text prompt decoded from expanded ids (one pad run per item) is refused with a message
    that names the run, for every modality of every demo architecture (not "0 placeholders")."""
    from tests.fidelity import content_part, make_prompt

    processor = processors[arch]
    for modality in sorted(processor.modalities):
        expanded = processor.tokenizer.decode(make_prompt(processor, modality).token_ids)
        with pytest.raises(PlaceholderMismatchError, match=f"expanded {modality} placeholder run") as caught:
            preprocess({"prompt": expanded, "content_parts": [content_part(modality)]}, processor=processor,
                       fetcher=fetcher, cache=None, transport=transport, limits=limits)
        assert "token_ids" in caught.value.message and caught.value.errors["items"] == 1
