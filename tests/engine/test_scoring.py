"""Teacher-forced scoring agrees with the logprobs generation reported, with and without images."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ContextLengthError, InvalidRequestError
from engine.generation import GenerationRequest
from engine.sampling_params import SamplingParams
from engine.scoring import ScoreRequest

ATOL = 1e-4  # measured ~1e-6 on fp32 CPU


def _generated(engine, prompts):
    image = prompts.image_features()
    requests = [
        GenerationRequest(prompts.text("The quick brown fox"), SamplingParams(max_tokens=10, temperature=0)),
        GenerationRequest(prompts.image_prompt("Describe the image.", image),
                          SamplingParams(max_tokens=7, temperature=0), mm_kwargs=image),
        # Sampled tokens score to their raw-distribution logprobs too (not the tempered ones).
        GenerationRequest(prompts.image_prompt("What colour?", image),
                          SamplingParams(max_tokens=5, temperature=1.3, top_k=50, seed=2), mm_kwargs=image),
    ]
    return requests, engine.generate(requests)


def test_scoring_generated_tokens_gives_the_generation_logprobs(engine, prompts):
    requests, generated = _generated(engine, prompts)
    scored = engine.score([
        ScoreRequest(r.prompt_token_ids, g.choices[0].token_ids, mm_kwargs=r.mm_kwargs)
        for r, g in zip(requests, generated, strict=True)
    ])
    for g, s in zip(generated, scored, strict=True):
        assert len(s.logprobs) == len(g.choices[0].token_ids)
        torch.testing.assert_close(s.logprobs, g.choices[0].logprobs, atol=ATOL, rtol=0)
        assert s.weight_version == engine.weight_version
        assert s.usage == {"prompt_tokens": len(s.prompt_token_ids), "completion_tokens": len(s.logprobs)}


def test_a_row_scores_the_same_alone_and_in_a_batch(engine, prompts):
    image = prompts.image_features()
    requests = [
        ScoreRequest(prompts.image_prompt("Describe.", image), prompts.text(" a red square"), mm_kwargs=image),
        ScoreRequest(prompts.text("Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12"), prompts.text(" 100")),
        ScoreRequest(prompts.text("A"), prompts.text(" picture is worth a thousand words.")),
    ]
    batched = engine.score(requests)
    for request, result in zip(requests, batched, strict=True):
        torch.testing.assert_close(engine.score([request])[0].logprobs, result.logprobs, atol=1e-5, rtol=0)


def test_completion_mm_token_type_ids_are_text_and_placeholder_ids_are_refused(engine, prompts):
    # transformers 5.x Qwen-VL needs mm_token_type_ids over the appended completion too
    # (0: text); a placeholder id in a completion would be taken for a media slot, so it is refused.
    from engine.batch_inputs import Row, collate

    image = prompts.image_features()
    prompt, completion = prompts.image_prompt("Hi", image), prompts.text(" a red square")
    batch = collate(engine.loaded, [Row([*prompt, *completion], image), Row(prompts.text("Yes."), {})])
    types = batch["mm_token_type_ids"]
    assert types.shape == batch["input_ids"].shape and int(types.sum()) == 4
    assert not types[0, -len(completion):].any()
    with pytest.raises(InvalidRequestError) as info:
        engine.score([ScoreRequest(prompt, [prompts.config.image_token_id, 9], mm_kwargs=image)])
    assert "completion_token_ids" in info.value.errors


def test_scoring_validates_before_running(engine, loaded, prompts):
    with pytest.raises(InvalidRequestError):
        engine.score([ScoreRequest(prompts.text("Hi"), [])])
    with pytest.raises(ContextLengthError):
        engine.score([ScoreRequest([9] * loaded.context_tokens, [9])])
    assert engine.score([]) == []


def test_llava_generation_batching_and_scoring_agree(tmp_path_factory):
    # LLaVA has no M-RoPE: positions come from the attention mask (as generate computes them).
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from engine.demo_model import build_demo_model
    from engine.generation import Engine
    from engine.loading import load_model

    directory = build_demo_model(tmp_path_factory.mktemp("models") / "llava", arch="llava")
    engine = Engine(load_model(str(directory), device="cpu"))
    config = engine.loaded.model.config
    tokenizer, processor = AutoTokenizer.from_pretrained(directory), AutoImageProcessor.from_pretrained(directory)
    image = {"pixel_values": processor(images=[Image.new("RGB", (64, 48), "red")], return_tensors="pt")["pixel_values"]}
    text = tokenizer("Describe the image in one sentence.", add_special_tokens=False)["input_ids"]
    requests = [
        GenerationRequest([config.image_token_index] * config.image_seq_length + text[:3],
                          SamplingParams(max_tokens=6, temperature=0), mm_kwargs=image),
        GenerationRequest(text * 3, SamplingParams(max_tokens=6, temperature=0.8, seed=1)),
    ]
    batched = engine.generate(requests)
    for request, result in zip(requests, batched, strict=True):
        assert engine.generate([request])[0].choices[0].token_ids == result.choices[0].token_ids
    scored = engine.score([ScoreRequest(r.prompt_token_ids, b.choices[0].token_ids, mm_kwargs=r.mm_kwargs)
                           for r, b in zip(requests, batched, strict=True)])
    for b, s in zip(batched, scored, strict=True):
        torch.testing.assert_close(s.logprobs, b.choices[0].logprobs, atol=ATOL, rtol=0)


@pytest.mark.gpu
def test_scoring_on_cuda_matches_cpu(demo_model_dir, engine, prompts):
    from engine.generation import Engine
    from engine.loading import load_model

    cuda = Engine(load_model(str(demo_model_dir), device="cuda"))
    image = prompts.image_features()
    requests = [ScoreRequest(prompts.image_prompt("Describe.", image), prompts.text(" a red square"),
                             mm_kwargs=image)]
    torch.testing.assert_close(cuda.score(requests)[0].logprobs, engine.score(requests)[0].logprobs,
                               atol=1e-3, rtol=0)


def test_scored_logprobs_in_slices_equal_them_in_one(monkeypatch):
    """A batch too large for one float32 matrix is taken in slices of positions, with the same answer."""
    from engine import scoring
    from engine.batch_inputs import Row

    generator = torch.Generator().manual_seed(0)
    rows = [Row(token_ids=list(range(10, 30 + i)), features={}) for i in range(5)]
    scored = [1, 4, 7, 2, 9]
    logits = torch.randn(5, max(scored) + 1, 64, generator=generator)
    whole = scoring.scored_logprobs(logits, rows, scored, top_k=3)
    monkeypatch.setattr(scoring, "_LOGPROB_ELEMENTS", 64 * 3)  # three positions per slice
    assert scoring.scored_logprobs(logits, rows, scored, top_k=3) == whole
    assert [len(lps) for lps, _ in whole] == scored and all(len(step) == 3 for _, top in whole for step in top)


@pytest.mark.gpu
def test_scored_logprobs_on_cuda_copy_to_the_host_once():
    """After the forward, a batch's logprobs and top-k come to the host in one copy, however many
    rows (torch's sync debug mode counts the synchronizing calls)."""
    import warnings

    from engine.batch_inputs import Row
    from engine.scoring import scored_logprobs

    rows = [Row(token_ids=list(range(10, 30 + i)), features={}) for i in range(8)]
    scored = [3 + i for i in range(8)]
    logits = torch.randn(8, max(scored) + 1, 640, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            on_device = scored_logprobs(logits, rows, scored, top_k=5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum("synchroniz" in str(w.message) for w in caught) <= 1
    on_host = scored_logprobs(logits.cpu(), rows, scored, top_k=5)
    for (device_lps, _), (host_lps, _) in zip(on_device, on_host, strict=True):
        assert device_lps == pytest.approx(host_lps, abs=1e-4)
