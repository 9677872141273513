"""An adapter updated in place in mode keep (#58 item 5): its rows go on under the new version from
their next token; the base's and another adapter's rows in the same batch never notice.

With ``recompute_kv`` a row's tokens after the update are what PEFT's forward of the new version
gives over the whole sequence so far, its tokens before what the old version's gives; a request
still waiting at the update runs under the new version alone, never finding the old version's
cached blocks. Each row's ``weight_versions`` names the adapter version of every token."""

from __future__ import annotations

import pytest

from engine.generation import Engine, GenerationRequest
from engine.loading import load_model
from engine.sampling_params import SamplingParams
from tests.engine.lora.lora_support import make_adapter, peft_reference
from tests.fidelity import assert_close

TOKENS, UPDATE_AT = 8, 3  # the update lands before step UPDATE_AT: the rows have that many tokens


@pytest.fixture(scope="module")
def adapter_a2(demo_model_dir, adapters_root):
    """A's next version: its configuration, other weights (a trainer's step)."""
    return make_adapter(demo_model_dir, adapters_root / "a2", rank=4, alpha=8, seed=3)


@pytest.fixture(scope="module")
def references(demo_model_dir, adapter_a, adapter_a2, adapter_b):
    return {"": peft_reference(demo_model_dir, None), "a@1": peft_reference(demo_model_dir, adapter_a),
            "a@2": peft_reference(demo_model_dir, adapter_a2), "b@1": peft_reference(demo_model_dir, adapter_b)}


@pytest.fixture
def engine(demo_model_dir, adapter_a, adapter_b):
    engine = Engine(load_model(str(demo_model_dir), device="cpu"))
    engine.load_adapter("a@1", adapter_a)
    engine.load_adapter("b@1", adapter_b)
    return engine


def run_through_update(engine, adapter_a2, prompt, *, recompute_kv: bool) -> dict:
    """Rows of a@1, b@1 and the base decode; before step UPDATE_AT a@1 is replaced in place by a@2
    in mode keep (as the GPU worker's adapter sync does it) and one more a@1 request arrives, queued
    before the update reached the scheduler."""
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    scheduler = engine.scheduler()
    results = {}
    try:
        for tag, adapter in (("a", "a@1"), ("b", "b@1"), ("base", "")):
            scheduler.submit(GenerationRequest(prompt, params, adapter=adapter), tag=tag)
        for step in range(4 * TOKENS):
            if step == UPDATE_AT:
                scheduler.submit(GenerationRequest(prompt, params, adapter="a@1"), tag="queued")
                engine.load_adapter("a@2", adapter_a2)
                engine.replace_adapter("a@1", "a@2", recompute_kv=recompute_kv)
                engine.unload_adapter("a@1")
            for finished in scheduler.step():
                assert finished.error is None, finished.error
                results[finished.tag] = finished.result.choices[0]
            if not scheduler.has_work:
                break
    finally:
        scheduler.close()
    assert sorted(results) == ["a", "b", "base", "queued"]
    assert engine.adapter_ids == ["a@2", "b@1"]
    return results


def spans(engine, *marks: tuple[int, int, str]) -> list[dict]:
    return [{"version": engine.weight_version, "start": start, "end": end, **({"adapter": a} if a else {})}
            for start, end, a in marks]


@pytest.mark.parametrize("recompute_kv", [True, False], ids=["recompute_kv", "kv_kept"])
def test_an_adapter_updated_in_mode_keep_carries_its_rows_over(engine, adapter_a2, references, prompts,
                                                                recompute_kv):
    prompt = prompts.text("An agent's rollout that lives through its trainer's step")
    results = run_through_update(engine, adapter_a2, prompt, recompute_kv=recompute_kv)

    kept = results["a"]
    assert len(kept.token_ids) == TOKENS and kept.finish_reason == "length", "it went on, not ended"
    assert kept.weight_versions == spans(engine, (0, UPDATE_AT, "a@1"), (UPDATE_AT, TOKENS, "a@2"))
    assert kept.kv_recomputed is recompute_kv
    before = references["a@1"].token_logprobs(prompt, kept.token_ids)
    assert_close(kept.logprobs[:UPDATE_AT], before[:UPDATE_AT], "tokens before the update: the old version's")
    if recompute_kv:  # its whole sequence under the new version: exactly PEFT's forward of a@2
        after = references["a@2"].token_logprobs(prompt, kept.token_ids)
        assert_close(kept.logprobs[UPDATE_AT:], after[UPDATE_AT:], "tokens after the update: the new version's")
    else:  # the new version's forward over the old KV: neither version's whole-sequence answer
        assert kept.logprobs[UPDATE_AT:] != pytest.approx(before[UPDATE_AT:], abs=1e-4)

    queued = results["queued"]  # renamed while it waited: never the old version's tokens or cached blocks
    assert queued.weight_versions == spans(engine, (0, TOKENS, "a@2"))
    assert_close(queued.logprobs, references["a@2"].token_logprobs(prompt, queued.token_ids), "queued under a@2")

    for tag, adapter in (("b", "b@1"), ("base", "")):  # the same batch, never paused nor changed
        choice = results[tag]
        assert choice.weight_versions == spans(engine, (0, TOKENS, adapter)) and choice.kv_recomputed is None
        assert_close(choice.logprobs, references[adapter].token_logprobs(prompt, choice.token_ids), tag)


def test_a_row_at_its_policy_lag_ends_at_the_update(engine, adapter_a2, prompts):
    """``max_policy_lag`` 0 bounds a row's staleness across an adapter's update as across the base's."""
    prompt = prompts.text("A row that may not outlive its policy")
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, max_policy_lag=0)
    scheduler = engine.scheduler()
    ended = {}
    try:
        scheduler.submit(GenerationRequest(prompt, params, adapter="a@1"), tag="a")
        scheduler.submit(GenerationRequest(prompt, params), tag="base")
        for step in range(4 * TOKENS):
            if step == UPDATE_AT:
                engine.load_adapter("a@2", adapter_a2)
                engine.replace_adapter("a@1", "a@2")
                engine.unload_adapter("a@1")
            for finished in scheduler.step():
                ended[finished.tag] = finished.result.choices[0]
            if not scheduler.has_work:
                break
    finally:
        scheduler.close()
    assert ended["a"].finish_reason == "policy_lag" and len(ended["a"].token_ids) == UPDATE_AT
    assert ended["base"].finish_reason == "length", "the base's rows cross no update of a"
