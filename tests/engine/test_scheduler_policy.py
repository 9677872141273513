"""The scheduler's policy stepped with no model (issue #48 item 2): a model is its facts
(:class:`engine.model_facts.ModelFacts`) and a runner that follows a fixed table (each token is
followed by the next id). What the policy decides is read off the runner's calls and the pool's
blocks: admission by blocks, prefix lookup, what a prefill starts after, chunking, preemption.
That every decision leaves each row's numbers the model's own is tested on real models
(tests/engine/test_scheduler.py, test_prefix_reuse.py, the fidelity contract)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.capacity import SchedulerLimits
from engine.generation import GenerationRequest
from engine.paged_kv import BlockPool, PagedPrompt, blocks_for
from engine.prompt_cache import PrefilledPrompt
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_runner import PromptInput

VOCAB = 64


@dataclass
class TableFacts:
    weight_version: str = "v1"
    eos_token_ids: tuple[int, ...] = (VOCAB - 1,)
    context_tokens: int | None = 1024
    media_token_ids: dict[str, int] = field(default_factory=dict)
    tokenizer: Any = None
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    vocab_size: int = VOCAB


def after(token: int) -> torch.Tensor:
    """The table's logits after ``token``: the next id, far ahead of the rest (never eos)."""
    logits = torch.full((VOCAB,), -20.0)
    logits[(token + 1) % (VOCAB - 1)] = 20.0
    return logits


class TableRunner:
    """A StepRunner with no model. Its pool's accounting is real (a prefill takes blocks after the
    prompt's cached prefix, a decode step makes each row's room); it records what it was asked."""

    attn_implementation = "sdpa"

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.calls: list[tuple] = []  # ("decode", rows) / ("prefill", [(length, start)]) / ("chunk", done)

    def decode(self, batch) -> torch.Tensor:
        batch.decode_inputs()  # each row's next slot in a block of its own
        self.calls.append(("decode", len(batch)))
        return torch.stack([after(int(token)) for token in batch.last])

    def prefill(self, prompts: list[PromptInput]) -> list[PrefilledPrompt]:
        self.calls.append(("prefill", [(len(p.token_ids), p.start) for p in prompts]))
        return [self._written(p) for p in prompts]

    def start_chunked(self, prompt: PromptInput) -> dict:
        return {"prompt": prompt, "done": prompt.start}

    def prefill_chunk(self, state: dict, chunk_tokens: int) -> PrefilledPrompt | None:
        prompt = state["prompt"]
        state["done"] = min(len(prompt.token_ids), state["done"] + chunk_tokens)
        self.calls.append(("chunk", state["done"]))
        return self._written(prompt) if state["done"] == len(prompt.token_ids) else None

    def drop_chunked(self, state: dict) -> None:
        self.pool.release(state["prompt"].prefix)
        state["prompt"].prefix = []

    def prompt_logprobs(self, request, features) -> dict[str, Any]:
        ids = request.prompt_token_ids
        pairs = zip(ids[:-1], ids[1:], strict=True)
        return {"prompt_logprobs": [None, *(float(torch.log_softmax(after(a), -1)[b]) for a, b in pairs)]}

    def _written(self, prompt: PromptInput) -> PrefilledPrompt:
        length = len(prompt.token_ids)
        blocks = [*prompt.prefix, *self.pool.allocate(blocks_for(length, self.pool.block_size) - len(prompt.prefix))]
        prompt.prefix = []
        return PrefilledPrompt(PagedPrompt(self.pool, blocks, length), after(prompt.token_ids[-1]), None, length)


def scheduler(facts=None, **limits) -> Scheduler:
    limits = SchedulerLimits(**{"kv_cache_tokens": 64 * 4, "kv_block_tokens": 4, "join_ratio": 0.0, **limits})
    return Scheduler(facts or TableFacts(), TableRunner(BlockPool(limits.kv_blocks, limits.kv_block_tokens)), limits)


def request(prompt, max_tokens=4, *, n=1, tenant="", scope="") -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, n=n, ignore_eos=True)
    return GenerationRequest(list(prompt), params, cache_scope=scope, tenant=tenant)


def run_to_end(sched: Scheduler) -> dict:
    results = {}
    while sched.has_work:
        for finished in sched.step():
            assert finished.error is None, finished.error
            results[finished.tag] = finished
    return results


def test_a_request_runs_by_the_table_and_gives_every_block_back():
    sched = scheduler()
    sched.submit(request([1, 2, 3], max_tokens=5), tag="a")
    [result] = [f.result for f in run_to_end(sched).values()]
    assert result.choices[0].token_ids == [4, 5, 6, 7, 8] and result.choices[0].finish_reason == "length"
    assert result.weight_version == "v1" and result.cached_tokens == 0
    # The first token comes from the prefill's logits; four decode steps give the rest.
    assert sched.runner.calls == [("prefill", [(3, 0)]), *[("decode", 1)] * 4]
    assert sched.pool.in_use == 0


def test_a_prompt_that_extends_a_finished_one_prefills_only_after_its_full_blocks():
    sched = scheduler()
    sched.submit(request(range(10), max_tokens=1))
    run_to_end(sched)
    sched.runner.calls.clear()
    sched.submit(request([*range(8), 40, 41, 42], max_tokens=1), tag="next")
    result = run_to_end(sched)["next"].result
    assert sched.runner.calls == [("prefill", [(11, 8)])]  # two full blocks of 4 found, the rest computed
    assert result.cached_tokens == 8


def test_a_prompt_found_whole_joins_with_no_forward_and_counts_every_token_cached():
    sched = scheduler()
    sched.submit(request(range(10), max_tokens=3))
    first = run_to_end(sched)[None].result
    sched.runner.calls.clear()
    sched.submit(request(range(10), max_tokens=3), tag="again")
    again = run_to_end(sched)["again"].result
    assert [c for c in sched.runner.calls if c[0] != "decode"] == []
    assert again.cached_tokens == 10 and again.choices[0].token_ids == first.choices[0].token_ids


def test_the_next_turn_finds_the_blocks_a_row_filled_while_decoding():
    sched = scheduler()
    sched.submit(request(range(6), max_tokens=7))  # the cache holds 12 tokens: the last one is never fed
    first = run_to_end(sched)[None].result
    turn = [*range(6), *first.choices[0].token_ids, 50, 51]  # 3 full blocks of history, then new tokens
    sched.runner.calls.clear()
    sched.submit(request(turn, max_tokens=1), tag="turn")
    assert run_to_end(sched)["turn"].result.cached_tokens == 12
    assert sched.runner.calls == [("prefill", [(15, 12)])]


def test_blocks_are_never_shared_across_cache_scopes_or_weight_versions():
    facts = TableFacts()
    sched = scheduler(facts)
    sched.submit(request(range(10), max_tokens=1, scope="key-a"))
    run_to_end(sched)
    sched.submit(request(range(10), max_tokens=1, scope="key-b"), tag="other key")
    assert run_to_end(sched)["other key"].result.cached_tokens == 0
    facts.weight_version = "v2"  # what an update does: the facts are read per request
    sched.submit(request(range(10), max_tokens=1, scope="key-a"), tag="new weights")
    result = run_to_end(sched)["new weights"].result
    assert result.cached_tokens == 0 and result.weight_version == "v2"


def test_samples_of_one_prompt_are_prefilled_once():
    sched = scheduler()
    sched.submit(request(range(9), n=3), tag="group")
    sched.submit(request(range(9)), tag="late sample")
    results = run_to_end(sched)
    assert [c for c in sched.runner.calls if c[0] == "prefill"] == [("prefill", [(9, 0)])]
    assert results["late sample"].result.cached_tokens == 9


def test_a_request_waits_for_blocks_and_runs_when_they_come_back():
    # 8 blocks of 4: each request peaks at 4 + 12 tokens = 4 blocks, so only two run at once.
    sched = scheduler(kv_cache_tokens=8 * 4, max_rows=8)
    for tag in "abc":
        sched.submit(request([ord(tag) - 90] * 4, max_tokens=12), tag=tag)
    most = 0
    while sched.has_work:
        sched.step()
        most = max(most, sched.running_rows)
        assert sched.pool.in_use <= 8
    assert most == 2 and sched.pool.in_use == 0


def test_a_key_below_its_share_preempts_the_newest_job_of_a_key_above_it_which_resumes_where_it_was():
    sched = scheduler(max_rows=4)
    sched.submit(request([1] * 4, max_tokens=40, n=2, tenant="a"), tag="a1")
    sched.submit(request([2] * 4, max_tokens=40, n=2, tenant="a"), tag="a2")
    for _ in range(6):  # the prefill's token and five decoded
        sched.step()
    assert sched.running_rows == 4
    sched.runner.calls.clear()
    sched.submit(request([3] * 4, max_tokens=2, tenant="b"), tag="b")
    assert sched.step() == []  # its decode gives a's rows a 7th token; then a2 gives way, its rows wait with them
    assert sched.stats.preempted_requests == 1 and sched.running_rows == 3  # a1's two rows and b's
    results = run_to_end(sched)
    assert results["b"].result.choices[0].token_ids == [4, 5]
    # a2's rows came back after b's: its prompt, and the full block each row named as it left, found
    # in the pool; each row's 7 tokens but the last (fed next) computed after them; not a token lost.
    assert ("prefill", [(10, 8), (10, 8)]) in sched.runner.calls
    assert [c.token_ids for c in results["a2"].result.choices] == [list(range(3, 43))] * 2
    assert sched.stats.preempted_requests == 1 and sched.pool.in_use == 0


def test_a_key_alone_keeps_the_whole_batch():
    sched = scheduler(max_rows=2)
    sched.submit(request([1] * 4, max_tokens=20, n=2, tenant="a"), tag="a1")
    sched.step()
    sched.submit(request([2] * 4, max_tokens=2, tenant="a"), tag="a2")
    run_to_end(sched)
    assert sched.stats.preempted_requests == 0


def test_a_long_prompt_is_prefilled_a_chunk_per_step_while_rows_decode():
    sched = scheduler(prefill_chunk_tokens=8)
    sched.submit(request([5] * 4, max_tokens=10), tag="decoding")
    sched.step()
    sched.runner.calls.clear()
    sched.submit(request(range(20), max_tokens=2), tag="long")
    results = run_to_end(sched)
    calls = sched.runner.calls
    chunks = [c for c in calls if c[0] == "chunk"]
    assert chunks == [("chunk", 8), ("chunk", 16), ("chunk", 20)]
    # a decode step of the running row between chunks: its pace is kept
    assert calls[:6] == [("decode", 1), ("chunk", 8), ("decode", 1), ("chunk", 16), ("decode", 1), ("chunk", 20)]
    assert results["long"].result.choices[0].token_ids == [20, 21]


def test_an_aborted_request_ends_with_its_tokens_so_far_and_frees_its_blocks():
    sched = scheduler()
    handle = sched.submit(request([1, 2, 3], max_tokens=50), tag="a")
    for _ in range(3):
        sched.step()
    sched.abort(handle)
    result = run_to_end(sched)["a"].result
    assert result.choices[0].finish_reason == "abort" and result.choices[0].token_ids == [4, 5, 6]
    assert sched.pool.in_use == 0


def test_prompt_logprobs_come_from_the_runner():
    sched = scheduler()
    params = dataclasses.replace(request([1, 2]).sampling, prompt_logprobs=0)
    sched.submit(GenerationRequest([1, 2, 9], params), tag="a")
    result = run_to_end(sched)["a"].result
    assert result.prompt_logprobs[0] is None and result.prompt_logprobs[1] > -1e-6 > result.prompt_logprobs[2]
