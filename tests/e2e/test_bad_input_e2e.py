"""Input that once reached a GPU worker and failed there (a 500) ends well through the whole stack
(issue #47 item 6): a one-token prompt with prompt logprobs on every dialect."""

from __future__ import annotations


def test_a_one_token_prompt_with_prompt_logprobs_succeeds_on_every_dialect(stack):
    model = stack.client.get("/v1/models", headers=stack.headers()).get_json()["data"][0]["id"]
    job = stack.wait(stack.submit({"token_ids": [100], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}})["id"])
    assert job["status"] == "succeeded", job
    assert job["result"]["prompt_logprobs"] == [None]
    for path, body in (
            ("/inference/v1/generate", {"model": model, "token_ids": [100],
                                        "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}),
            ("/generate", {"input_ids": [100], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True,
                           "logprob_start_len": 0}),
            ("/v1/completions", {"model": model, "prompt": [100], "max_tokens": 2, "echo": True, "logprobs": 1})):
        reply = stack.client.post(path, json=body, headers=stack.headers())
        assert reply.status_code == 200, (path, reply.status_code, reply.get_json())
    echoed = reply.get_json()["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][0] is None and len(echoed["token_logprobs"]) == 3  # the prompt token, then two


def test_openai_routes_take_a_request_without_model_as_vllm_does(stack):
    """AReaL's vLLM backend sends no ``model``: the served model is meant (2 of the replay's 3 misses)."""
    messages = [{"role": "user", "content": "Say hi."}]
    for path, body in (("/v1/completions", {"prompt": [100, 101], "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                       ("/v1/completions/render", {"prompt": "Say hi."}),
                       ("/v1/chat/completions/render", {"messages": messages})):
        reply = stack.client.post(path, json=body, headers=stack.headers())
        assert reply.status_code == 200, (path, reply.status_code, reply.get_json())
    wrong = stack.client.post("/v1/completions", json={"model": "gpt-4", "prompt": [100], "max_tokens": 1},
                              headers=stack.headers())
    assert wrong.status_code == 404 and wrong.get_json()["error"]["code"] == "model_not_found"
