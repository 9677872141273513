"""OpenAI's ``/v1/completions``: a body's prompts as job requests, and the jobs' results as its reply
(choices, logprobs in the completions shape, usage)."""

from __future__ import annotations

from typing import Any

from domain.jobs.results import JobResult
from engine.choice import Choice
from engine.errors import InvalidRequestError
from engine.routing.encoding import nested
from web.dialects.common import (
    TokenTexts,
    carry_request_fields,
    native_request,
    prompt_logprobs_of,
    reply_model_name,
    tokenizer,
    usage,
    vocab_size,
)
from web.dialects.openai.request import (
    FIELD_NAMES,
    check_model,
    native_params,
    prompts_of,
    speller,
    stop_reason,
)
from web.dialects.sampling import RENAMED


def completion_requests(body: dict[str, Any]) -> list[dict[str, Any]]:
    if body.get("stream") and body.get("echo"):
        raise InvalidRequestError("echo is not served with stream: true", errors={"echo": ["not with stream"]})
    check_model(body.get("model"))
    prompts, batch = prompts_of(body["prompt"])
    tok = tokenizer()
    requests = []
    for i, prompt in enumerate(prompts):
        ids = prompt if isinstance(prompt, list) else tok(prompt, add_special_tokens=body.get(
            "add_special_tokens", True))["input_ids"]
        params = native_params(body)
        k = body.get("logprobs")
        params["logprobs"] = k is not None
        if k:
            params["top_logprobs"] = k
        if body.get("echo") and k is not None:
            params.setdefault("prompt_logprobs", k)
        native = carry_request_fields(body, {"token_ids": ids, "sampling_params": params})
        names = {f"sampling_params.{n}": RENAMED.get(n, n) for n in params} | FIELD_NAMES
        if batch:
            names["token_ids"] = f"prompt[{i}]"
        requests.append(native_request(native, names, vocab_size=vocab_size(), tokenized=ids is not prompt))
    return requests


def completion_reply(body: dict[str, Any], requests: list[dict], jobs: list[dict], created: int) -> dict:
    texts = TokenTexts()
    spell = speller(texts, body.get("return_tokens_as_token_ids", False))
    prompts, _ = prompts_of(body["prompt"])
    choices, results = [], []
    for i, (request, job) in enumerate(zip(requests, jobs, strict=True)):
        n = request["sampling_params"]["n"]
        result = JobResult.of(job, n=n)
        results.append(result)
        prompt_ids = result.prompt_token_ids or request["token_ids"]
        echo_text = ""
        if body.get("echo"):
            echo_text = prompts[i] if isinstance(prompts[i], str) else tokenizer().decode(prompt_ids)
        for choice in result.choices:
            entry = {"index": i * n + choice.index, "text": echo_text + (choice.text or ""),
                     "logprobs": completion_logprobs(choice, result, prompt_ids, body, spell)
                     if body.get("logprobs") is not None else None,
                     "finish_reason": choice.finish_reason, "stop_reason": stop_reason(choice)}
            if body.get("return_token_ids"):
                entry.update(prompt_token_ids=prompt_ids, token_ids=choice.token_ids)
            if body.get("prompt_logprobs") is not None:  # vLLM's extra, per choice in its completion reply
                entry["prompt_logprobs"] = prompt_logprobs_of(result, texts)
            if request["sampling_params"].get("sampling_mask"):  # return_sampling_mask: vLLM's CSR
                entry["sampling_mask"] = choice.sampling_mask
            if request["sampling_params"].get("routed_experts"):  # return_routed_experts: vLLM's lists
                entry["routed_experts"] = nested(choice.routed_experts)
            choices.append(entry)
    return {"id": "cmpl-" + jobs[0]["id"].removeprefix("job_"), "object": "text_completion", "created": created,
            "model": reply_model_name(), "choices": choices, "usage": usage(*results),
            "system_fingerprint": JobResult.of(jobs[0]).weight_version}


def completion_logprobs(choice: Choice, result: JobResult | None, prompt_ids: list[int], body: dict, spell) -> dict:
    """vLLM's ``CompletionLogProbs`` of a choice (with ``echo``, the prompt's first)."""
    ids, lps = list(choice.token_ids), list(choice.logprobs or [])
    tops = list(choice.top_logprobs or [[] for _ in ids])
    if body.get("echo") and result is not None:
        prompt_lps = result.prompt_logprobs or [None] * len(prompt_ids)
        prompt_tops = result.prompt_top_logprobs or [[] for _ in prompt_ids]
        ids, lps, tops = list(prompt_ids) + ids, list(prompt_lps) + lps, [t or [] for t in prompt_tops] + tops
    tokens = [spell(t) for t in ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    top_dicts = []
    for token_id, lp, step in zip(ids, lps, tops, strict=True):
        # vLLM's dict: the sampled token and the k most likely ones.
        entry = {} if lp is None else {spell(token_id): lp}
        for alt, alt_lp in step:
            entry.setdefault(spell(alt), alt_lp)
        top_dicts.append(entry or None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_dicts, "text_offset": offsets}


