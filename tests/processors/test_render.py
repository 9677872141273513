"""/v1/render: chat messages to the exact token ids a job with those ids reproduces."""

from __future__ import annotations

import pytest

from engine.demo_model import IMAGE_ARCHS
from engine.errors import Fault, InvalidRequestError
from processors.pipeline import preprocess
from processors.render import render


def messages_with_images(url_a, url_b):
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": url_a}},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": {"url": url_b}, "uuid": "img-b"},
        ]},
    ]


@pytest.mark.parametrize("arch", IMAGE_ARCHS)
def test_rendered_ids_come_back_unchanged(arch, processors, fetcher, transport, limits, image_url):
    processor = processors[arch]
    url_a, url_b = image_url(64, 48, 1), image_url(40, 90, 2)
    rendered = render(messages_with_images(url_a, url_b), processor, fetcher=fetcher)
    assert rendered["content_parts"] == [
        {"type": "image_url", "url": url_a}, {"type": "image_url", "url": url_b, "uuid": "img-b"}]

    job = preprocess({"token_ids": rendered["token_ids"], "content_parts": rendered["content_parts"]},
                     processor=processor, fetcher=fetcher, cache=None, transport=transport, limits=limits)
    assert job.prompt_token_ids == rendered["token_ids"]  # expanded runs are never expanded again
    lengths = [len(processor.replacement_ids(f, 0)) for f in (
        processor.process_images([img], {}) for img in _decode(fetcher, url_a, url_b))]
    assert [r["length"] for r in job.placeholder_ranges] == lengths


def _decode(fetcher, *urls):
    from processors.decode import decode_image

    return [decode_image(fetcher.fetch(url).data, max_pixels=10**8) for url in urls]


def test_render_matches_the_chat_template_text_path(processors, fetcher, transport, limits, image_url):
    processor = processors["qwen2_vl"]
    messages = messages_with_images(image_url(64, 48, 1), image_url(40, 90, 2))
    rendered = render(messages, processor, fetcher=fetcher)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                      {"type": "text", "text": " with "}, {"type": "image"}]}],
        tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|vision_start|><|image_pad|>") == 2
    job = preprocess({"prompt": text, "content_parts": rendered["content_parts"]}, processor=processor,
                     fetcher=fetcher, cache=None, transport=transport, limits=limits)
    assert job.prompt_token_ids == rendered["token_ids"]


def test_render_fills_the_cache_for_the_job_that_follows(processors, fetcher, transport, limits, cache, image_url):
    processor = processors["qwen2_vl"]
    rendered = render(messages_with_images(image_url(64, 48, 1), image_url(40, 90, 2)), processor,
                      fetcher=fetcher, cache=cache)
    job = preprocess({"token_ids": rendered["token_ids"], "content_parts": rendered["content_parts"]},
                     processor=processor, fetcher=fetcher, cache=cache, transport=transport, limits=limits)
    assert job.cache_hits == 2 and job.prompt_token_ids == rendered["token_ids"]


def test_text_only_and_malformed_messages(processors, fetcher):
    processor = processors["llava"]
    rendered = render([{"role": "user", "content": "hi"}], processor, fetcher=fetcher)
    assert rendered["content_parts"] == []
    assert rendered["token_ids"] == processor.tokenizer("USER: hi\nASSISTANT:", add_special_tokens=False)["input_ids"]
    for bad in ([], [{"content": "no role"}], [{"role": "user", "content": [{"type": "audio"}]}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "not-an-object"}]}]):
        with pytest.raises(InvalidRequestError):
            render(bad, processor, fetcher=fetcher)


def test_video_parts_render_to_expanded_runs_a_job_keeps(processors, fetcher, transport, limits, video_url):
    processor = processors["qwen2_vl"]
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": video_url(frames=4)}, "uuid": "clip"},
        {"type": "text", "text": "What happens?"}]}]
    rendered = render(messages, processor, fetcher=fetcher, limits=limits)
    assert rendered["content_parts"] == [{"type": "video_url", "url": messages[0]["content"][0]["video_url"]["url"],
                                          "uuid": "clip"}]
    assert rendered["token_ids"].count(processor.token_id("video")) == 8
    job = preprocess({"token_ids": rendered["token_ids"], "content_parts": rendered["content_parts"]},
                     processor=processor, fetcher=fetcher, cache=None, transport=transport, limits=limits)
    assert job.prompt_token_ids == rendered["token_ids"]


def test_render_of_an_image_past_the_aspect_ratio_limit_is_a_decode_error(processors, fetcher):
    """A 20000x2 image: the model's processor would refuse it untyped; render names the part."""
    import base64
    import io

    from PIL import Image

    from engine.errors import MediaError

    buffer = io.BytesIO()
    Image.new("RGB", (20000, 2), (10, 20, 30)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is it?"}]}]
    with pytest.raises(MediaError) as refused:
        render(messages, processors["qwen2_vl"], fetcher=fetcher)
    assert refused.value.code == "media_decode_failed" and refused.value.fault is Fault.INVALID


def test_a_string_uuid_is_kept_in_the_content_parts(processors, fetcher, image_url):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(64, 48, 3)},
                                              "uuid": "img-1"}, {"type": "text", "text": "Describe it."}]}]
    rendered = render(messages, processors["qwen2_vl"], fetcher=fetcher)
    assert rendered["content_parts"][0]["uuid"] == "img-1"
