"""Prefix reuse through the whole stack: an agent's next turn, sent as a new job on the native and
OpenAI routes, finds the KV blocks the last turn computed (``cached_tokens``, OpenAI's
``usage.prompt_tokens_details.cached_tokens``), and gets the tokens a fresh computation gives;
another API key or another ``cache_salt`` finds nothing."""

from __future__ import annotations

from tests.e2e.conftest import OTHER_KEY

BLOCK = 16  # ROLLOUT_KV_BLOCK_TOKENS' default
GREEDY = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True, "logprobs": True}
HISTORY = list(range(300, 340))  # 40 tokens: two full blocks and a partial one


def held_blocks(prompt: list[int], completion: list[int]) -> int:
    """The tokens a finished row leaves in full, named blocks: its prompt and all but its last token."""
    return (len(prompt) + len(completion) - 1) // BLOCK * BLOCK


def test_a_next_turn_reuses_the_last_turns_blocks_on_every_route_and_only_within_its_key_and_salt(stack):
    first = stack.wait(stack.submit({"token_ids": HISTORY, "sampling_params": GREEDY})["id"])
    completion = first["result"]["choices"][0]["token_ids"]
    turn = [*HISTORY, *completion, 400, 401, 402, 403, 404]
    second = stack.wait(stack.submit({"token_ids": turn, "sampling_params": GREEDY})["id"])
    assert second["result"]["cached_tokens"] == held_blocks(HISTORY, completion) > 0

    # The same tokens from another key, or the same key with a cache_salt, compute everything; and
    # every computation gives the same greedy tokens and logprobs.
    other = stack.wait(stack.submit({"token_ids": turn, "sampling_params": GREEDY}, key=OTHER_KEY)["id"],
                       key=OTHER_KEY)
    salted = stack.wait(stack.submit({"token_ids": turn, "sampling_params": GREEDY, "cache_salt": "run-7"})["id"])
    assert other["result"]["cached_tokens"] == 0 and salted["result"]["cached_tokens"] == 0
    for job in (other, salted):
        [want], [got] = second["result"]["choices"], job["result"]["choices"]
        assert got["token_ids"] == want["token_ids"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < 1e-4

    # OpenAI's completions route, token prompt: the salted turn's blocks are found by its salt only.
    model = stack.client.get("/v1/models", headers=stack.headers()).get_json()["data"][0]["id"]
    body = {"model": model, "prompt": [*turn, 405], "max_tokens": 4, "temperature": 0.0, "cache_salt": "run-7"}
    reply = stack.client.post("/v1/completions", json=body, headers=stack.headers())
    assert reply.status_code == 200, reply.get_json()
    assert reply.get_json()["usage"]["prompt_tokens_details"] == {"cached_tokens": len(turn) // BLOCK * BLOCK}
    unsalted = stack.client.post("/v1/completions", json={**body, "cache_salt": "run-8"}, headers=stack.headers())
    assert unsalted.get_json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
