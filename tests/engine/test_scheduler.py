"""The continuous scheduler on tiny real models (fp32, CPU): rows join and leave between steps and
every row still decodes exactly as it would alone."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from engine.demo_model import IMAGE_ARCHS, build_demo_model
from engine.errors import CapacityError, Fault
from engine.generation import GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from tests.engine.media_prompts import image_tokens
from tests.engine.scheduler_models import Model

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, top_logprobs=5)


def sampled(seed, max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True, **kw)


def run(scheduler, submissions, *, steps_between=0, burst=1):
    """Submit ``[(request, kwargs)]`` (``burst`` at first, then one every ``steps_between``
    steps), step until done; results by tag, and the live rows of every decode step."""
    results, rows_per_step, pending = {}, [], list(submissions)
    while pending or scheduler.has_work:
        for _ in range(len(pending) if not steps_between else burst if not rows_per_step else 1):
            if pending:
                request, kwargs = pending.pop(0)
                scheduler.submit(request, **kwargs)
        for _ in range(max(steps_between, 1)):
            rows_per_step.append(scheduler.running_rows)
            for finished in scheduler.step():
                assert finished.error is None, finished.error
                results[finished.tag] = finished.result
    return results, rows_per_step


def neighbours(model: Model, count: int, seed: int = 0) -> list[GenerationRequest]:
    """Requests of different lengths, media and output lengths, to churn a batch."""
    rng = random.Random(seed)
    texts = ["Yes.", "The weather today is sunny with a light breeze from the west.", "Count the objects.",
             "A man is riding a bicycle along the river while children play football in the park."]
    sizes = [(64, 48), (112, 56), (56, 112), (84, 84)]
    out = []
    for i in range(count):
        params = sampled(seed=100 + i, max_tokens=rng.randint(1, 9)) if i % 2 else dataclasses.replace(
            GREEDY, max_tokens=rng.randint(1, 9))
        image = None
        if model.image_processor is not None and i % 3 != 2:
            image = model.image(sizes[i % len(sizes)], ["red", "green", "blue"][i % 3])
        out.append(model.request(texts[i % len(texts)], params, image))
    return out


def transformers_alone(model: Model, request: GenerationRequest) -> dict:
    """Greedy tokens, their raw logprobs and the top 5 per step of ``request`` alone, by
    transformers' own ``generate`` (its cache, positions and M-RoPE), as a reference outside
    the scheduler."""
    from engine.batch_inputs import Row, collate

    batch = collate(model.loaded, [Row(request.prompt_token_ids, dict(request.mm_kwargs or {}))])
    with torch.inference_mode():
        out = model.loaded.model.generate(**batch, max_new_tokens=request.sampling.max_tokens, do_sample=False,
                                          output_logits=True, return_dict_in_generate=True,
                                          pad_token_id=model.loaded.fill_token_id)
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    tokens = out.sequences[0, batch["input_ids"].shape[1]:]
    top = torch.topk(logprobs, 5, dim=-1)
    return {"tokens": tokens.tolist(), "logprobs": logprobs.gather(1, tokens[:, None])[:, 0].tolist(),
            "top_ids": top.indices.tolist(), "top_values": top.values.tolist()}


def assert_matches_transformers(reference: dict, result, atol=1e-5):
    choice = result.choices[0]
    assert choice.token_ids == reference["tokens"]
    torch.testing.assert_close(choice.logprobs, reference["logprobs"], atol=atol, rtol=0)
    assert [[t for t, _ in step] for step in choice.top_logprobs] == reference["top_ids"]
    torch.testing.assert_close([[v for _, v in step] for step in choice.top_logprobs], reference["top_values"],
                               atol=atol, rtol=0)


def assert_same_row(alone, churned, atol=1e-5):
    for a, b in zip(alone.choices, churned.choices, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)
        for step_a, step_b in zip(a.top_logprobs or [], b.top_logprobs or [], strict=True):
            assert [t for t, _ in step_a] == [t for t, _ in step_b]
            torch.testing.assert_close([v for _, v in step_a], [v for _, v in step_b], atol=atol, rtol=0)


@pytest.mark.parametrize("arch", [*IMAGE_ARCHS, "text"])
def test_a_row_in_a_churning_batch_decodes_as_it_does_alone(models, arch):
    """Every registered architecture through the same loop. The target row joins a running batch,
    rows of other lengths and media (other M-RoPE deltas) join and leave while it decodes, and
    its tokens and raw logprobs (top 5 per step) equal those of the row alone."""
    model = models(arch)
    image = model.image((84, 56), "purple") if model.image_processor is not None else None
    target = model.request("Describe the image in one sentence.", dataclasses.replace(GREEDY, max_tokens=8), image)
    reference = transformers_alone(model, target)

    engine = model.engine(max_rows=3, prompt_cache_tokens=0)
    live_with_target = []

    def on_step(events):
        if any(e.tag == "target" for e in events):
            live_with_target.append(frozenset(e.tag for e in events))

    scheduler = engine.scheduler(on_step=on_step)
    others = neighbours(model, 8)
    submissions = [(r, {"tag": i}) for i, r in enumerate(others[:3])]
    submissions += [(target, {"tag": "target"})] + [(r, {"tag": 3 + i}) for i, r in enumerate(others[3:])]
    results, _ = run(scheduler, submissions, steps_between=1)
    assert len(set(live_with_target)) > 2, live_with_target  # rows joined and left around the target
    assert_matches_transformers(reference, results["target"])
    assert_matches_transformers(reference, model.engine().generate([target])[0])
    for i, request in enumerate(others[:4]):
        assert_same_row(model.engine().generate([request])[0], results[i])


def test_a_seeded_job_gives_the_same_tokens_alone_and_among_40_jobs_joining_and_leaving(models):
    model = models("qwen2_vl")
    target = model.request("What colour is the square?", sampled(seed=1234, max_tokens=12), model.image())
    alone = model.engine().generate([target])[0]

    engine = model.engine(max_rows=8)
    jobs = neighbours(model, 40, seed=3)
    submissions = [(r, {"tag": i}) for i, r in enumerate(jobs)]
    submissions.insert(20, (target, {"tag": "target"}))
    results, rows_per_step = run(engine.scheduler(), submissions, steps_between=1, burst=12)
    assert max(rows_per_step) == 8 and len(set(rows_per_step)) > 3
    assert results["target"].choices[0].token_ids == alone.choices[0].token_ids
    torch.testing.assert_close(results["target"].choices[0].logprobs, alone.choices[0].logprobs, atol=1e-5, rtol=0)

    # Sampled-token logprobs agree with teacher-forced scoring of the same tokens.
    from engine.scoring import ScoreRequest

    scored = engine.score([ScoreRequest(r.prompt_token_ids, results[i].choices[0].token_ids, mm_kwargs=r.mm_kwargs)
                           for i, r in enumerate(jobs)])
    for i, score in enumerate(scored):
        torch.testing.assert_close(results[i].choices[0].logprobs, score.logprobs, atol=1e-4, rtol=0)


def test_a_prompt_group_is_prefilled_once_and_reports_cached_tokens(models):
    model = models("qwen2_vl")
    engine = model.engine(max_rows=16)
    image = model.image((84, 84), "green")
    group = [model.request("Describe the image.", sampled(seed=s), image) for s in range(4)]
    other = model.request("Describe the image.", sampled(seed=9), model.image((84, 84), "blue"))
    n3 = model.request("Count the objects.", sampled(seed=5, n=3))
    results = engine.generate([*group, other, n3])
    length = len(group[0].prompt_token_ids)
    # Same ids, other image: another prompt. n=3: one prompt computed once for its three rows.
    assert engine.stats.prefill_tokens == 2 * length + len(n3.prompt_token_ids)
    assert [r.cached_tokens for r in results] == [0, length, length, length, 0, 0]
    assert engine.stats.cached_tokens == 3 * length
    for request, result in zip(group + [other, n3], results, strict=True):  # forked rows decode as alone
        assert_same_row(model.engine().generate([request])[0], result)
    assert len({tuple(r.choices[0].token_ids) for r in results[:4]}) == 4  # seeds differ, prompts shared

    # A member arriving after its group ended still finds the prompt in the recent-prompt cache.
    late = engine.generate([model.request("Describe the image.", sampled(seed=77), image)])[0]
    assert late.cached_tokens == length and engine.stats.prefill_tokens == 2 * length + len(n3.prompt_token_ids)
    assert_same_row(model.engine().generate([model.request("Describe the image.", sampled(seed=77), image)])[0], late)
    # Without its last logits kept, a later member computes only what follows its full cached blocks.
    without_ends = model.engine(prompt_cache_tokens=0)
    without_ends.generate([group[0]])
    assert without_ends.generate([group[1]])[0].cached_tokens == (length - 1) // 16 * 16
    assert without_ends.stats.prefill_tokens == length + length - (length - 1) // 16 * 16
    without_reuse = model.engine(prefix_caching=False)
    without_reuse.generate([group[0]])
    assert without_reuse.generate([group[1]])[0].cached_tokens == 0


def test_prompts_are_shared_only_within_one_cache_scope(models):
    """The service scopes by API key: another key's identical prompt is computed again, so its
    cached_tokens (and timing) say nothing of what the first key sent."""
    model = models("qwen2_vl")
    engine = model.engine(max_rows=16)

    def request(scope: str, seed: int) -> GenerationRequest:
        return dataclasses.replace(model.request("Describe the image.", sampled(seed=seed)), cache_scope=scope)

    together = engine.generate([request("key_a", 1), request("key_b", 2), request("key_a", 3)])
    assert [r.cached_tokens for r in together] == [0, 0, len(together[0].prompt_token_ids)]
    later = engine.generate([request("key_b", 4), request("key_c", 5)])  # the recent-prompt cache too
    assert [r.cached_tokens for r in later] == [len(later[0].prompt_token_ids), 0]


def test_the_vision_encoder_runs_once_per_image_and_a_second_epoch_hits_the_cache(models):
    from engine.items import MultimodalItem

    model = models("qwen2_vl")
    engine = model.engine(prompt_cache_tokens=0)

    def epoch(question: str):
        requests = []
        for i, color in enumerate(["red", "green", "blue"]):
            image = model.image((84, 84), color)
            ids = image_tokens("qwen2_vl", model.loaded.model.config, model.tokenizer, image) + model.text(question)
            start = ids.index(model.loaded.model.config.image_token_id)
            item = MultimodalItem("image", image, (start, start + 9), content_hash=f"img-{color}")
            requests += [GenerationRequest(ids, sampled(seed=i * 10 + g), items=[item]) for g in range(2)]
        return requests

    first = engine.generate(epoch("Describe the image."))
    assert (engine.encoder_cache.stats.calls, engine.encoder_cache.stats.hits) == (3, 0)  # one per image
    second = engine.generate(epoch("What colour is it?"))
    assert (engine.encoder_cache.stats.calls, engine.encoder_cache.stats.hits) == (3, 3)
    uncached = model.engine(encoder_cache_bytes=0, prompt_cache_tokens=0).generate(epoch("What colour is it?"))
    for a, b in zip(second, uncached, strict=True):
        assert_same_row(a, b, atol=1e-6)
    assert first[0].choices[0].logprobs != second[0].choices[0].logprobs  # another prompt


def test_the_encoder_cache_is_bounded_in_bytes_lru():
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from engine.encoder_cache import EncoderCache

    cache = EncoderCache(max_bytes=3 * 400)
    out = lambda: {"image": BaseModelOutputWithPooling(pooler_output=(torch.zeros(100),))}  # noqa: E731
    for key in "abc":
        cache.put(key, out())
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", out())
    assert cache.get("b") is None and all(cache.get(k) is not None for k in "acd")
    assert cache.nbytes == 1200
    cache.put("huge", {"image": BaseModelOutputWithPooling(pooler_output=(torch.zeros(1000),))})
    assert cache.get("huge") is None and cache.nbytes == 1200


def test_abort_mid_batch_ends_that_request_only_with_its_tokens_so_far(models):
    model = models("qwen2_vl")
    engine = model.engine()
    scheduler = engine.scheduler()
    requests = [model.request("Yes.", sampled(seed=1, max_tokens=10)),
                model.request("Count the objects.", sampled(seed=2, max_tokens=10, n=2), model.image())]
    handles = [scheduler.submit(r, tag=i) for i, r in enumerate(requests)]
    results, steps = {}, 0
    while scheduler.has_work:
        steps += 1
        if steps == 4:
            scheduler.abort(handles[1])
        for finished in scheduler.step():
            results[finished.tag] = finished.result
    assert [c.finish_reason for c in results[1].choices] == ["abort", "abort"]
    assert all(len(c.token_ids) == 3 for c in results[1].choices)
    assert results[0].choices[0].finish_reason == "length" and len(results[0].choices[0].token_ids) == 10
    full = model.engine().generate([requests[1]])[0]
    assert [c.token_ids[:3] for c in full.choices] == [c.token_ids for c in results[1].choices]


def test_tokens_so_far_are_each_choices_prefix_of_its_result(models):
    model = models("qwen2_vl")
    scheduler = model.engine().scheduler()
    request = model.request("Count.", sampled(seed=3, max_tokens=12, n=2, logprobs=True, min_tokens=12))
    handle = scheduler.submit(request, tag="job")
    for _ in range(5):
        scheduler.step()
    so_far = scheduler.tokens_so_far(handle)
    results = []
    while scheduler.has_work:
        results += [finished.result for finished in scheduler.step()]
    (result,) = results
    assert [c.index for c in so_far] == [0, 1] and all(c.finish_reason is None for c in so_far)
    for choice, ended in zip(so_far, result.choices, strict=True):
        assert 0 < len(choice.token_ids) < 12 and choice.token_ids == ended.token_ids[:len(choice.token_ids)]
        assert choice.logprobs == ended.logprobs[:len(choice.logprobs)] and len(choice.logprobs) == len(choice.token_ids)
    assert scheduler.tokens_so_far(handle) == []  # ended


def test_a_deadline_stops_a_request_and_marks_it_timed_out(models):
    model = models("qwen2_vl")
    scheduler = model.engine().scheduler()
    scheduler.submit(model.request("Yes.", sampled(seed=1, max_tokens=12)), tag="free")
    scheduler.submit(model.request("No.", sampled(seed=2, max_tokens=12)), tag="limited",
                     time_limit=3600)
    scheduler.step()
    scheduler.step()
    scheduler._jobs[1].deadline = time.monotonic()  # its time is up now
    ended = {}
    while scheduler.has_work:
        for finished in scheduler.step():
            ended[finished.tag] = finished
    assert ended["limited"].timed_out and ended["limited"].result.choices[0].finish_reason == "abort"
    assert len(ended["limited"].result.choices[0].token_ids) == 2
    assert not ended["free"].timed_out and len(ended["free"].result.choices[0].token_ids) == 12


def test_a_request_that_fails_in_prefill_ends_alone(models):
    model = models("qwen2_vl")
    image = model.image()
    good = model.request("Describe the image.", sampled(seed=1), image)
    # Placeholders for a 16-patch image, pixels of a 4x larger one: the model refuses the row.
    bad = GenerationRequest(good.prompt_token_ids, sampled(seed=2), mm_kwargs=model.image((128, 96)))
    scheduler = model.engine().scheduler()
    for tag, request in (("good", good), ("bad", bad), ("text", model.request("Yes.", sampled(seed=3)))):
        scheduler.submit(request, tag=tag)
    ended = {}
    while scheduler.has_work:
        for finished in scheduler.step():
            ended[finished.tag] = finished
    assert isinstance(ended["bad"].error, RuntimeError | ValueError) and ended["bad"].result is None
    assert ended["good"].error is None and ended["text"].error is None
    assert_same_row(model.engine().generate([good])[0], ended["good"].result)


def test_a_request_whose_forward_overflows_fails_alone_and_leaves_no_dirty_block(models):
    """Issue #47's attack: image features of absurd magnitude (3e38) turn one request's forward into
    NaN. That request fails alone with a typed error, and neither its neighbours in the same batch nor
    the requests that later get its blocks see its values: each decodes as it does on a clean pool."""
    model = models("qwen2_vl")
    image = model.image()
    huge = {**image, "pixel_values": torch.full_like(image["pixel_values"], 3e38)}
    bad = GenerationRequest(model.request("Describe the image.", GREEDY, image).prompt_token_ids,
                            dataclasses.replace(GREEDY, max_tokens=40), mm_kwargs=huge)
    crowd = [model.request(text, sampled(seed=s, max_tokens=40)) for s, text in
             enumerate(["Yes.", "The weather today is", "Count the objects.", "A man is riding a bicycle"])]
    alone = [model.engine().generate([request])[0] for request in crowd]

    engine = model.engine(kv_cache_tokens=64 * 16, prompt_cache_tokens=0)
    scheduler = engine.scheduler()
    for tag, request in [("bad", bad), *enumerate(crowd)]:
        scheduler.submit(request, tag=tag)
    ended = {}
    while scheduler.has_work:
        for finished in scheduler.step():
            ended[finished.tag] = finished
    assert ended["bad"].error.code == "non_finite_output" and ended["bad"].error.fault is Fault.INVALID
    for i, result in enumerate(alone):
        assert_same_row(result, ended[i].result)
    assert engine.kv_pool.in_use == 0
    # Every block the bad row wrote went back to the pool; the next requests take them first.
    again = engine.generate(crowd)
    for result, want in zip(again, alone, strict=True):
        assert_same_row(want, result)


def test_a_poisoned_pool_hands_out_clean_blocks(models):
    """Whatever a block's last holder left in it (here NaN in every block of the pool), a row that
    takes it decodes as on a clean pool: a decode step gathers each row's last block whole, and a
    NaN in its masked tail would otherwise reach attention."""
    model = models("qwen2_vl")
    crowd = [model.request(text, sampled(seed=s, max_tokens=20)) for s, text in
             enumerate(["Yes.", "The weather today is sunny with a light breeze.", "Count the objects."])]
    engine = model.engine(kv_cache_tokens=32 * 16, prompt_cache_tokens=0)
    clean = engine.generate(crowd)
    assert engine.kv_pool.in_use == 0
    for layer in (*engine.kv_pool.keys, *engine.kv_pool.values):
        layer[:, 1:] = float("nan")  # every block but the null one, which no row ever writes
    for result, want in zip(engine.generate(crowd), clean, strict=True):
        assert_same_row(want, result)


def test_a_keys_backlog_does_not_keep_another_keys_job_waiting_behind_all_of_it(models):
    """Issue #47: admission was first come first served, so another key's job waited behind a key's
    whole bulk. Now the key with the least recent use goes next: b's job joins as soon as a's first
    rows end (a's running rows have fewer steps left than b's job: they are not preempted for it),
    ahead of a's queued jobs."""
    model = models("qwen2_vl")
    scheduler = model.engine(max_rows=4).scheduler()
    for i in range(12):  # a's bulk: one row each, 4 tokens: three waves of 4 rows
        scheduler.submit(dataclasses.replace(model.request(f"Job {i} of the bulk.", sampled(seed=i, max_tokens=4)),
                                             tenant="key_a"), tag=f"a{i}")
    scheduler.step()
    scheduler.submit(dataclasses.replace(model.request("Mine.", sampled(seed=99, max_tokens=4)), tenant="key_b"),
                     tag="b")
    ended, step = {}, 0
    while scheduler.has_work:
        step += 1
        ended |= {f.tag: step for f in scheduler.step()}
    assert ended["b"] == ended["a4"] < ended["a8"], ended  # in a's second wave, not after its backlog
    assert scheduler.stats.preempted_requests == 0


def _tenant(model, text: str, tenant: str, **params):
    return dataclasses.replace(model.request(text, sampled(**params)), tenant=tenant)


def test_rows_that_fill_the_batch_give_way_to_another_key_below_its_share(models):
    """Issue #47: a key's long rows filled the batch and another key's short job waited for them
    to end (minutes). Now the newest of them is preempted at the next step (its rows wait with their
    tokens, engine/preemption.py), and the other key's job runs beside the rest."""
    model = models("qwen2_vl")
    scheduler = model.engine(max_rows=6).scheduler()
    for i in range(3):
        scheduler.submit(_tenant(model, f"Long job {i}.", "bulk", seed=i, n=2, max_tokens=40),
                         tag=f"bulk{i}")
    for _ in range(3):
        assert scheduler.step() == []
    assert scheduler.running_rows == 6  # a key alone takes every row
    scheduler.submit(_tenant(model, "Short.", "other", seed=7, max_tokens=4), tag="short")
    ended = scheduler.step()
    assert ended == [] and scheduler.running_rows == 5  # bulk2's two rows gave way to short's, prefilled at once
    assert scheduler.stats.preempted_requests == 1
    steps = 1
    while "short" not in [f.tag for f in ended]:
        ended = scheduler.step()
        steps += 1
        assert all(f.tag == "short" for f in ended), ended
    # Its prefill gave its first token at once (bulk2 waits on it: no wait for company), three decode
    # steps the rest; bulk0 and bulk1 (40 tokens) still run, bulk2 resumes at the next step.
    assert steps == 4
    assert scheduler.running_rows == 4


def test_a_preempted_request_resumes_to_the_tokens_it_has_alone(models, monkeypatch):
    """Requests of several keys in one Engine.generate: one preempted for another's share resumes
    where it was (its rows' KV computed again, engine/preemption.py), and every result comes back
    equal to the request alone (seeded)."""
    from engine import preemption as scheduler_module

    model = models("qwen2_vl")
    engine = model.engine(kv_cache_tokens=4 * 16, kv_block_tokens=16)  # one request's 3 blocks at a time
    # b's job is shorter than what a has left when it is preempted (else a is not preempted for it).
    requests = [_tenant(model, "First.", "a", seed=1, max_tokens=40), _tenant(model, "Second.", "b", seed=2, max_tokens=28)]
    alone = [engine.generate([request])[0] for request in requests]
    engine.usage.half_life_s = 0  # their runs alone forgotten: a, first come, runs first
    real, forced = scheduler_module.fair_share_victim, []

    def once_the_oldest_running(waiting, need, shares, running, tenants, usage):  # forced once, whatever the shares
        if running and not forced:
            forced.append(running[0])
            return 0
        return real(waiting, need, shares, running, tenants, usage)

    monkeypatch.setattr(scheduler_module, "fair_share_victim", once_the_oldest_running)
    together = engine.generate(requests)
    assert forced == [("a", forced[0][1])] and engine.stats.preempted_requests == 1
    for got, want in zip(together, alone, strict=True):
        assert got is not None and got.choices[0].token_ids == want.choices[0].token_ids


def test_a_request_that_is_the_whole_batch_is_not_preempted_and_others_wait_for_it(models):
    model = models("qwen2_vl")
    scheduler = model.engine(max_rows=4).scheduler()
    scheduler.submit(_tenant(model, "All rows.", "bulk", seed=1, n=4, max_tokens=6), tag="bulk")
    scheduler.step()
    scheduler.submit(_tenant(model, "Short.", "other", seed=7, max_tokens=2), tag="short")
    order = []
    while scheduler.has_work:
        order += [f.tag for f in scheduler.step()]
    assert order == ["bulk", "short"]
    assert scheduler.stats.preempted_requests == 0  # bulk would drop below its share: no preemption


def test_rows_and_kv_budget_bound_admission_and_a_request_that_never_fits_is_refused(models):
    model = models("qwen2_vl")
    prompt = model.text("The weather today is")
    assert len(prompt) + 8 <= 16  # each row's prompt and tokens fit one block of 16
    engine = model.engine(max_rows=4, kv_cache_tokens=3 * 16, kv_block_tokens=16)
    with pytest.raises(CapacityError) as info:
        engine.scheduler().check(GenerationRequest(prompt, sampled(seed=1, n=5)))
    assert info.value.fault is Fault.INVALID and info.value.code == "request_exceeds_capacity"
    with pytest.raises(CapacityError):
        engine.scheduler().check(GenerationRequest(prompt, sampled(seed=1, max_tokens=4 * len(prompt) + 40)))
    _, rows_per_step = run(engine.scheduler(), [(GenerationRequest(prompt, sampled(seed=s)), {"tag": s})
                                                for s in range(7)])
    assert max(rows_per_step) == 3  # the KV pool's 3 blocks, not the 4 rows, hold it


def test_a_long_prompt_is_prefilled_in_chunks_while_other_rows_keep_decoding(models):
    model = models("qwen2_vl")
    image = model.image((112, 112), "orange")
    long_text = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)
    long = model.request(long_text, dataclasses.replace(GREEDY, max_tokens=4), image)
    long.prompt_token_ids = long.prompt_token_ids + model.text(long_text)  # image first, then ~400 tokens
    assert len(long.prompt_token_ids) > 400
    alone = model.engine().generate([long])[0]  # one forward: nothing to keep going

    engine = model.engine(prefill_chunk_tokens=48)
    tokens_per_step = []
    scheduler = engine.scheduler(on_step=lambda events: tokens_per_step.append({e.tag for e in events}))
    scheduler.submit(model.request("Yes.", dataclasses.replace(GREEDY, max_tokens=30)), tag="short")
    scheduler.step()
    scheduler.submit(long, tag="long")
    results = {}
    while scheduler.has_work:
        for finished in scheduler.step():
            results[finished.tag] = finished.result
    first_long = next(i for i, tags in enumerate(tokens_per_step) if "long" in tags)
    assert first_long >= len(long.prompt_token_ids) // 48  # chunks over many steps...
    assert all("short" in tags for tags in tokens_per_step[:first_long])  # ...the short row decoding in each
    assert_same_row(alone, results["long"])


def test_jobs_arriving_one_per_step_join_a_busy_batch_a_few_per_prefill_and_decode_as_alone(models):
    """Fresh prompts arriving one per step: with joins waiting for company (the default) a few
    share each prefill forward, where each paid its own before; every job's tokens and logprobs are
    those it gets alone."""
    model = models("text")
    words = ["red", "green", "blue", "cyan", "gold", "grey", "pink", "teal"]
    jobs = [model.request(f"Name the colour {words[i % 8]} number {i}.", dataclasses.replace(GREEDY, max_tokens=3 + i % 5))
            for i in range(24)]
    forwards, results = {}, {}
    for ratio in (0.5, 0.0):
        engine = model.engine(max_rows=8, prompt_cache_tokens=0, join_ratio=ratio, join_wait_steps=4)
        results[ratio], _ = run(engine.scheduler(), [(r, {"tag": i}) for i, r in enumerate(jobs)], steps_between=1)
        forwards[ratio] = engine.stats.prefill_forwards
    assert forwards[0.0] == len(jobs) and forwards[0.5] <= len(jobs) * 2 // 3, forwards
    for i, request in enumerate(jobs):
        alone = model.engine().generate([request])[0]
        assert_same_row(alone, results[0.5][i])
        assert_same_row(alone, results[0.0][i])


def test_the_step_hook_sees_every_token_of_every_row(models):
    model = models("qwen2_vl")
    events = []
    engine = model.engine()
    requests = [model.request("Yes.", sampled(seed=1, max_tokens=5, n=2)), model.request("No.", GREEDY)]
    results = engine.generate(requests, on_step=events.extend)
    for i, result in enumerate(results):
        for choice in result.choices:
            mine = [e for e in events if e.tag == i and e.choice == choice.index]
            assert [e.token_id for e in mine] == choice.token_ids
            assert [e.finish_reason for e in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]


@pytest.mark.gpu
def test_a_row_in_a_churning_batch_on_cuda_matches_alone(tmp_path):
    model = Model("qwen2_vl", build_demo_model(tmp_path / "m"))
    model.loaded = load_model(str(tmp_path / "m"), device="cuda")
    target = model.request("Describe the image.", dataclasses.replace(GREEDY, max_tokens=8), model.image())
    alone = model.engine().generate([target])[0]
    others = neighbours(model, 12)
    submissions = [(r, {"tag": i}) for i, r in enumerate(others)]
    submissions.insert(5, (target, {"tag": "target"}))
    results, _ = run(model.engine(max_rows=4).scheduler(), submissions, steps_between=1)
    assert results["target"].choices[0].token_ids == alone.choices[0].token_ids
    torch.testing.assert_close(results["target"].choices[0].logprobs, alone.choices[0].logprobs, atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_a_decode_step_on_cuda_synchronizes_with_the_host_once(tmp_path):
    """The batched sampler's claim (engine/batch_sampler.py): one device-to-host copy per decode step
    for every row's token and logprob, counted by torch's own sync debug mode."""
    import warnings

    model = Model("qwen2_vl", build_demo_model(tmp_path / "m"))
    model.loaded = load_model(str(tmp_path / "m"), device="cuda")
    scheduler = model.engine(max_rows=8).scheduler()
    for seed in range(8):
        scheduler.submit(model.request("The weather today is", sampled(seed=seed, max_tokens=40)))
    scheduler.step()  # admission and prefill: syncs of their own
    scheduler.step()
    syncs = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(8):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                scheduler.step()
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scheduler.running_rows == 8 and max(syncs) <= 1, syncs


def test_a_scheduler_closed_with_rows_running_gives_the_pool_back(models):
    """A GPU session that ends mid-run (Redis away, an error) closes its scheduler: the engine's KV
    pool must not keep the blocks of rows that will run again elsewhere."""
    model = models("qwen2_vl")
    engine = model.engine(prompt_cache_tokens=0)
    scheduler = engine.scheduler()
    for seed in range(3):
        scheduler.submit(GenerationRequest(model.text("The weather today is"), sampled(seed=seed, n=2, max_tokens=50)))
    scheduler.submit(GenerationRequest(model.text("Yes."), sampled(seed=9, max_tokens=50)))
    for _ in range(4):
        scheduler.step()
    assert scheduler.running_rows == 7 and engine.kv_pool.in_use > 0
    scheduler.close()
    assert engine.kv_pool.in_use == 0 and not scheduler.has_work and scheduler.running_rows == 0
    # The engine serves on: a later call is unaffected.
    assert engine.generate([GenerationRequest(model.text("Yes."), sampled(seed=1, max_tokens=4))])[0].choices
    assert engine.kv_pool.in_use == 0
