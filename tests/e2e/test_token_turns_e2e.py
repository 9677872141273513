"""Token-exact turns end to end (#57 item 4): the demo-qwen3 model, a real GPU worker, the API on
loopback and the official ``openai`` client.

- verifiers' token-in flow: turn one on chat with ``return_token_ids``, the bridge from two
  ``/tokenize`` calls (a stand-in assistant with and without the new messages, as verifiers'
  ``OpenAIChatCompletionsTokenClient.get_prompt_ids`` computes it), turn two on
  ``/v1/chat/completions/tokens``: its prompt is the stitched ids exactly and its KV prefix is
  found in the cache; bad tokens are a 4xx in OpenAI's shape.
- a session over plain chat (``X-Session-ID``): turn two's prompt starts with turn one's prompt
  and sampled ids exactly, where rendering the messages again would not (thinking on: the
  template writes the returned reasoning in a think block the model never sampled), streamed
  too; the trajectory is one sequence with its mask, logprobs and versions; another key gets 404.

The random model seldom ends a turn by itself: its turns end at max_tokens, so the template's end
of turn is given before the bridge (``end_of_turn: given``); the sampled-end case is checked on the
real tokenizers in tests/domain/sessions/test_bridge.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.chat_demo import chat_demo_stack, openai_client
from tests.e2e.conftest import API_KEY, OTHER_KEY
from tests.e2e.dialect_server import serve

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(redis_url, loopback_host, tmp_path_factory):
    with chat_demo_stack(redis_url, loopback_host, tmp_path_factory, "token-turns") as built:
        yield built


@pytest.fixture(scope="module")
def served(stack):
    with serve(stack) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(served):
    return openai_client(served)


def tokenize(served, **body) -> list[int]:
    reply = httpx.post(f"{served}/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    shaped = reply.json()
    assert shaped["count"] == len(shaped["tokens"]) and shaped["max_model_len"] > 0
    return shaped["tokens"]


def verifiers_bridge(served, new_messages, tools, last_id, eot) -> list[int]:
    """The bridge as verifiers computes it from /tokenize: a stand-in assistant rendered with the
    new messages and alone; what follows its end of turn (the end of turn itself when the last
    turn was cut before writing one)."""
    stand_in = {"role": "assistant", "reasoning_content": "", "content": "x"}
    full = tokenize(served, messages=[stand_in, *new_messages], tools=tools)
    base = tokenize(served, messages=[stand_in], tools=tools, add_generation_prompt=False)
    assert full[:len(base)] == base
    at = max(i for i, t in enumerate(base) if t == eot)
    return full[at + 1:] if last_id == eot else full[at:]


def test_verifiers_token_in_flow_stitches_turns_and_finds_the_cached_prefix(client, served):
    model = client.models.list().data[0].id
    session = {"X-Session-ID": "verifiers-1"}  # recorded too: token-in turns extend its trajectory
    one = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=12, temperature=0,
                                         logprobs=True, extra_body={"return_token_ids": True}, extra_headers=session)
    prompt1, sampled1 = one.model_extra["prompt_token_ids"], one.choices[0].model_extra["token_ids"]
    assert prompt1 == tokenize(served, messages=ASK, tools=[WEATHER])
    assert len(one.choices[0].logprobs.content) == len(sampled1)
    eot = tokenize(served, prompt="<|im_end|>", add_special_tokens=False)[0]
    env = [{"role": "user", "content": "And in Rome?"}]
    stitched = prompt1 + sampled1 + verifiers_bridge(served, env, [WEATHER], sampled1[-1], eot)
    messages = [*ASK, one.choices[0].message.model_dump(exclude_none=True), *env]
    raw = client.post("/chat/completions/tokens", cast_to=httpx.Response, body={
        "model": model, "messages": messages, "tools": [WEATHER], "tokens": stitched, "max_completion_tokens": 8,
        "temperature": 0, "logprobs": True, "return_token_ids": True}, options={"headers": session})
    two = openai.types.chat.ChatCompletion.model_validate_json(raw.content)
    assert two.model_extra["prompt_token_ids"] == stitched
    assert two.model_extra["prompt_token_ids"][:len(prompt1) + len(sampled1)] == prompt1 + sampled1
    assert len(two.choices[0].model_extra["token_ids"]) == 8 and two.choices[0].message.role == "assistant"
    # Turn one's prompt and decoded tokens were kept by name: turn two computes only what is new.
    assert two.usage.prompt_tokens_details.cached_tokens >= len(prompt1) // 2
    assert two.model_extra["session"]["prompt"] == "tokens" and raw.headers["X-Session-Prompt"] == "tokens"
    [segment] = httpx.get(f"{served}/v1/sessions/verifiers-1/trajectory", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=30).json()["segments"]
    assert segment["token_ids"] == stitched + two.choices[0].model_extra["token_ids"]
    assert sum(segment["loss_mask"]) == len(sampled1) + 8


def test_streamed_completions_carry_the_prompt_ids_in_each_choices_first_chunk(client, served):
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=4, n=2, stream=True,
                                            temperature=1, seed=3, extra_body={"return_token_ids": True}))
    expected = tokenize(served, prompt="Once upon a time")
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.model_extra.get("prompt_token_ids"))
            if firsts[choice.index] is not choice.model_extra.get("prompt_token_ids"):
                assert choice.model_extra.get("prompt_token_ids") is None
    assert firsts == {0: expected, 1: expected}


def test_bad_tokens_are_a_4xx_in_openais_shape(client):
    model = client.models.list().data[0].id
    for tokens, code in (([1, 10**6], "token_id_out_of_range"), ([1] * 100_000, None), ([], None), ("abc", None)):
        with pytest.raises(openai.APIStatusError) as refused:
            client.post("/chat/completions/tokens", cast_to=httpx.Response,
                        body={"model": model, "messages": ASK, "tokens": tokens, "max_tokens": 4})
        assert 400 <= refused.value.status_code < 500, refused.value.body
        assert refused.value.body["message"] and refused.value.body["code"]
        if code:
            assert refused.value.body["code"] == code


def test_a_session_continues_the_sampled_ids_where_a_render_would_drift(client, served, stack):
    model = client.models.list().data[0].id
    args = {"model": model, "tools": [WEATHER], "max_tokens": 10, "temperature": 0, "logprobs": True,
            "extra_body": {"return_token_ids": True}, "extra_headers": {"X-Session-ID": "agent 1"}}
    one = client.chat.completions.create(messages=ASK, **args)
    assert one.model_extra["session"] == {"id": "agent 1", "prompt": "rendered", "reason": "first_turn",
                                          "end_of_turn": None, "recorded": True}
    sequence1 = one.model_extra["prompt_token_ids"] + one.choices[0].model_extra["token_ids"]
    messages = [*ASK, one.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And Rome?"}]
    raw = client.chat.completions.with_raw_response.create(messages=messages, **args)
    assert raw.headers["X-Session-Prompt"] == "continued"
    two = raw.parse()
    assert two.model_extra["prompt_token_ids"][:len(sequence1)] == sequence1
    assert two.model_extra["session"]["prompt"] == "continued"
    assert two.model_extra["session"]["end_of_turn"] in ("sampled", "given")
    # Rendered from its messages, the same turn would not start with what the model sampled.
    assert tokenize(served, messages=messages, tools=[WEATHER])[:len(sequence1)] != sequence1
    assert two.usage.prompt_tokens_details.cached_tokens > 0

    # Turn three, streamed: the first chunk carries the prompt's ids, every chunk its own.
    sequence2 = two.model_extra["prompt_token_ids"] + two.choices[0].model_extra["token_ids"]
    messages3 = [*messages, two.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks"}]
    streamed = client.chat.completions.with_raw_response.create(messages=messages3, stream=True, **args)
    assert streamed.headers["X-Session-Prompt"] == "continued"
    chunks = list(streamed.parse())
    prompt3 = chunks[0].model_extra["prompt_token_ids"]
    assert prompt3[:len(sequence2)] == sequence2
    sampled3 = [t for chunk in chunks for choice in chunk.choices for t in choice.model_extra.get("token_ids") or []]
    assert len(sampled3) == 10

    # A turn that does not extend the last one is rendered, and says why.
    other = client.chat.completions.create(messages=[{"role": "user", "content": "Start over"}], **args)
    assert other.model_extra["session"]["reason"] == "messages_do_not_extend"

    trajectory = httpx.get(f"{served}/v1/sessions/agent%201/trajectory", headers=stack.headers(), timeout=30).json()
    assert trajectory["turns"] == 4
    first, second = trajectory["segments"]
    assert first["token_ids"] == prompt3 + sampled3
    sampled = [one.choices[0].model_extra["token_ids"], two.choices[0].model_extra["token_ids"], sampled3]
    assert sum(first["loss_mask"]) == sum(map(len, sampled))
    starts = [t["sampled_start"] for t in first["turns"]]
    for start, ids, reply in zip(starts, sampled, (one, two, None), strict=True):
        assert first["token_ids"][start:start + len(ids)] == ids and set(first["loss_mask"][start:start + len(ids)]) == {1}
        if reply is not None:  # the trajectory's logprobs are the reply's
            assert first["logprobs"][start:start + len(ids)] == pytest.approx(
                [entry.logprob for entry in reply.choices[0].logprobs.content])
    assert all(v for v, m in zip(first["weight_versions"], first["loss_mask"], strict=True) if m)
    assert [t["prompt"] for t in first["turns"]] == ["rendered", "continued", "continued"]
    assert second["turns"][0]["reason"] == "messages_do_not_extend"
    other_key = httpx.get(f"{served}/v1/sessions/agent%201/trajectory", headers=stack.headers(OTHER_KEY), timeout=30)
    assert other_key.status_code == 404 and other_key.json()["code"] == "session_not_found"
