"""The fidelity contract, route side: on every registered architecture and every modality it takes,
every route a trainer reads a logprob from returns the model's own numbers, equal (to
``tests.fidelity.TOLERANCE``) to transformers' forward computed here on the ids the route reports
it consumed and the same media. The engine side is ``tests/engine/test_fidelity_contract.py``.

Routes (each with media as data: URLs, where it takes them):

- native: ``POST /v1/jobs`` generation, greedy (a text prompt with the model's placeholder) and
  seeded at temperature 1 (expanded token ids), with top-k and prompt logprobs, and ``n: 2`` (both
  choices); ``kind: "score"`` jobs; ``POST /v1/generate`` (the synchronous native route),
  generation and scoring;
- streams: ``GET /v1/jobs/{id}/events`` and each dialect's ``stream: true``: the streamed logprobs
  equal the job's result and the reference;
- batches: our JSONL format (``/v1/batches/{id}/output``; text score lines are scored without
  jobs, media ones as jobs) and OpenAI's (``/v1/files`` + ``/v1/batches``; ``/v1/jobs``,
  ``/v1/chat/completions`` and ``/v1/completions`` lines);
- SGLang ``/generate`` (``meta_info.output_token_logprobs``, ``output_top_logprobs``,
  ``input_token_logprobs``, ``input_top_logprobs``), one prompt or a batch of every modality's;
- vLLM ``/inference/v1/generate`` (``logprobs.content``, ``prompt_logprobs``), with ``content_parts``
  and after ``/v1/chat/completions/render`` (its ``features`` passed back);
- OpenAI ``/v1/completions`` (``token_logprobs``, ``top_logprobs``, prompt ones with ``echo``) and
  ``/v1/chat/completions`` (``logprobs.content``: vLLM's OpenAI server serves the same shape).

Prompt ids are the ones each route reports it consumed (a job's ``prompt_token_ids``, SGLang's
``input_token_logprobs``, ``return_token_ids``, vLLM's ``prompt_token_ids`` where the reply has
them); where a route reports none (vLLM's generate without them), the ids it was sent, which
already have the media runs expanded (``make_prompt``, the service's own preprocessing).

``/v1/completions`` takes no media (its ``prompt`` is text or token ids; neither OpenAI's API nor
vLLM's has a media field there), so it is checked on text prompts only, in each of its forms.

The stack serves one model, so each architecture gets one stack, started once: the first test of
an architecture sends every request of every modality at once (they share the GPU worker's
batches, as a trainer's do), the stack stops, and each (architecture, modality) test checks its
replies. Stacks take two Redis databases in turn: one stops in the background while the next
starts. The differences measured per route are printed (``pytest -rP``).

No route may return a media placeholder id as a sampled token (README: they are never sampled; a
forward would take one for a media slot it has no features for).
"""

from __future__ import annotations

import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.conftest import empty_db_url
from tests.e2e.conftest import API_KEY, build_stack, log_dir_for, make_stack_env
from tests.fidelity import (
    Reference,
    assert_close,
    assert_top_logprobs,
    demo_dir_for,
    demo_dirs,
    make_prompt,
    registry_cases,
)

TOP = 3
NEW_TOKENS = 4
# The engine contract's seed. Unmasked, its third draw on Qwen2.5-Omni would be a media placeholder
# id (633); the service never samples those, which every route's tokens are checked for.
SEED = 11
DBS = (17, 18)  # see tests/conftest.py's db_url; architectures' stacks take them in turn
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": NEW_TOKENS, "temperature": 1.0, "seed": SEED, "ignore_eos": True}
SCORED = " a red square on a blue background"
QUESTION = "Describe it briefly."
SGLANG_STREAM_START = 2  # the streamed SGLang call's logprob_start_len: prompt logprobs from the third token
SGLANG_MEDIA = {"image": "image_data", "video": "video_data", "audio": "audio_data"}
CASES = list(registry_cases())


# --- what a route said, and the check against the reference --------------------------------------


@dataclass
class Seen:
    """One route's numbers for one sequence, with the ids it reports (prompt: pads expanded)."""

    route: str
    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    logprobs: list | None = None  # per completion token
    top: list | None = None  # per completion token: [[id, logprob], ...], exactly the k most likely, in order
    # Per completion token, alternatives in another shape ([(id, logprob), ...]); the ``best`` highest
    # of them must be the distribution's most likely, or with ``others`` its most likely other than
    # the sampled token (vLLM: the sampled token, then the k - 1 most likely others).
    shown: list | None = None
    best: int = TOP
    others: bool = False
    prompt_logprobs: list | None = None  # per prompt token from ``prompt_from`` (the second)
    prompt_shown: list | None = None  # per prompt token from ``prompt_from``: [(id, logprob), ...]
    prompt_best: int = TOP
    prompt_from: int = 1


def _assert_shown(shown: list, rows: torch.Tensor, best: int, what: str, excluded: list[int] | None = None) -> float:
    """Every alternative's logprob is the model's for that token, and the ``best`` highest are the
    distribution's most likely values, leaving out the ``excluded`` token of each position where
    given (near-ties may swap ids, not values)."""
    worst = 0.0
    assert len(shown) == len(rows), f"{what}: {len(shown)} positions, expected {len(rows)}"
    for i, (step, row) in enumerate(zip(shown, rows, strict=True)):
        assert step or not best, f"{what}: position {i} shows no alternatives"
        worst = max(worst, assert_close([lp for _, lp in step], [float(row[t]) for t, _ in step],
                                        f"{what} position {i}"))
        if excluded is not None:
            row = row.clone()
            row[excluded[i]] = -torch.inf
            assert excluded[i] not in [t for t, _ in step], f"{what} position {i}: the sampled token again"
        want = min(best, len(step))
        values = sorted((lp for _, lp in step), reverse=True)[:want]
        worst = max(worst, assert_close(values, torch.topk(row, want).values.tolist(),
                                        f"{what} position {i}: the {want} most likely"))
    return worst


def check(seen: Seen, reference: Reference, items, media_ids: set[int]) -> float:
    """Assert ``seen`` against the reference; the worst difference found."""
    worst = 0.0
    assert seen.prompt, f"{seen.route}: no prompt ids"
    drawn = [token for token in seen.completion if token in media_ids]
    assert not drawn, f"{seen.route}: sampled media placeholder ids {drawn} (README: they are never sampled)"
    completion = seen.completion
    if seen.logprobs is not None or seen.top is not None or seen.shown is not None:
        assert completion, f"{seen.route}: no completion tokens"
        # Row i: the distribution of completion token i, after the prompt and the tokens before it.
        start = len(seen.prompt) - 1
        rows = reference.distributions([*seen.prompt, *completion], items)[start:start + len(completion)]
    if seen.logprobs is not None:
        assert len(seen.logprobs) == len(completion), \
            f"{seen.route}: {len(seen.logprobs)} logprobs for {len(completion)} tokens"
        worst = max(worst, assert_close(seen.logprobs, reference.token_logprobs(seen.prompt, completion, items),
                                        f"{seen.route}: token logprobs"))
    if seen.top is not None:
        assert_top_logprobs(seen.top, reference, seen.prompt, completion, items, TOP, f"{seen.route}: top logprobs")
        worst = max(worst, _assert_shown(seen.top, rows, TOP, f"{seen.route}: top logprobs"))
    if seen.shown is not None:
        worst = max(worst, _assert_shown(seen.shown, rows, seen.best, f"{seen.route}: top logprobs",
                                         completion if seen.others else None))
    if seen.prompt_logprobs is not None:
        want = reference.prompt_logprobs(seen.prompt, items)[seen.prompt_from - 1:]
        worst = max(worst, assert_close(seen.prompt_logprobs, want, f"{seen.route}: prompt logprobs"))
    if seen.prompt_shown is not None:
        rows = reference.distributions(seen.prompt, items)[seen.prompt_from - 1:-1]
        worst = max(worst, _assert_shown(seen.prompt_shown, rows, seen.prompt_best, f"{seen.route}: prompt top"))
    return worst


class MemoReference(Reference):
    """The reference, each sequence's forward computed once (many routes report the same one)."""

    def __init__(self, model_dir, hf_processor):
        super().__init__(model_dir, hf_processor)
        self._memo: dict = {}

    def distributions(self, token_ids, items=()):
        key = (tuple(token_ids), tuple(id(item) for item in items))
        if key not in self._memo:
            self._memo[key] = super().distributions(token_ids, items)
        return self._memo[key]


def media_token_ids(config) -> set[int]:
    """The ids transformers' forward takes for media slots (as ``engine.loading`` reads them)."""
    names = ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id",
             "audio_token_index")
    return {value for name in names if isinstance(value := getattr(config, name, None), int)}


# --- one architecture's stack: every request of every modality --------------------------------------


@dataclass
class Case:
    modality: str
    prompt: Any  # tests.fidelity.Prompt
    completion: list[int]  # scored after the prompt

    @property
    def url(self) -> str:
        return self.prompt.parts[0]["url"]

    def media(self) -> dict:
        return {"content_parts": self.prompt.parts} if self.prompt.parts else {}

    def messages(self) -> list[dict]:
        if self.modality == "text":
            return [{"role": "user", "content": QUESTION}]
        part = {"image": {"type": "image_url", "image_url": {"url": self.url}},
                "video": {"type": "video_url", "video_url": {"url": self.url}},
                "audio": {"type": "input_audio", "input_audio": {"data": self.url.partition(",")[2],
                                                                 "format": "wav"}}}[self.modality]
        return [{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}]


class Failed:
    """A call that raised: kept in place of its reply, so that only its route fails."""

    def __init__(self, error: BaseException):
        self.error = error


def outcome(call, *args) -> Any:
    try:
        return call(*args)
    except Exception as error:
        return Failed(error)


class Replies(dict):
    """What each route answered, by name; reading one that failed raises its error."""

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise AssertionError(f"{name}: no reply")
        value = super().__getitem__(name)
        if isinstance(value, Failed):
            raise AssertionError(f"{name}: {type(value.error).__name__}: {value.error}")
        return value


@dataclass
class Served:
    registered: str
    reference: Reference
    media_ids: set[int]
    cases: dict[str, Case]
    replies: dict[str, Replies]  # modality -> route -> what it answered
    seconds: float


def _sse(text: str) -> list[dict]:
    """Server-Sent Events as ``{event, data}`` (data parsed as JSON where it is)."""
    out = []
    for block in text.split("\n\n"):
        event, data = "message", []
        for line in block.splitlines():
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)
        if data:
            raw = "\n".join(data)
            out.append({"event": event, "data": raw if raw == "[DONE]" else json.loads(raw)})
    return out


class Caller:
    """Calls on the stack's in-process API, each on its own test client (they run in threads)."""

    def __init__(self, stack):
        self.stack = stack

    def post(self, path: str, body: dict, status: int = 200) -> Any:
        response = self.stack.app.test_client().post(path, json=body, headers=HEADERS)
        assert response.status_code == status, f"{path}: {response.status_code} {response.get_json()}"
        return response.get_json()

    def get(self, path: str) -> Any:
        response = self.stack.app.test_client().get(path, headers=HEADERS)
        assert response.status_code == 200, f"{path}: {response.status_code} {response.get_data(as_text=True)}"
        return response

    def stream(self, path: str, body: dict | None = None) -> list[dict]:
        client = self.stack.app.test_client()
        if body is None:
            response = client.get(path, headers=HEADERS)
        else:
            response = client.post(path, json=body, headers=HEADERS)
        text = response.get_data(as_text=True)
        assert response.status_code == 200, f"{path}: {response.status_code} {text[:500]}"
        return _sse(text)

    def job(self, job_id: str, timeout: float = 120.0) -> dict:
        done = self.stack.services.jobs.wait(job_id, timeout=timeout)
        assert done is not None, f"job {job_id} did not end in {timeout}s"
        job = self.get(f"/v1/jobs/{job_id}").get_json()
        assert job["status"] == "succeeded", f"job {job_id}: {job['status']} {job.get('error')}"
        return job

    def batch(self, batch_id: str, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            batch = self.get(f"/v1/batches/{batch_id}?view=native").get_json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                return batch
            assert time.monotonic() < deadline, f"batch {batch_id} still {batch['status']}"
            time.sleep(0.05)


def _jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _native_bodies(case: Case) -> dict[str, dict]:
    """The native requests of a case, by name (batch lines reuse them)."""
    p = case.prompt
    sampled = {**SEEDED, "top_logprobs": TOP, "prompt_logprobs": TOP}
    return {
        # A text prompt with the model's placeholder: the service tokenizes and expands it.
        "greedy": {"prompt": p.text, **case.media(),
                   "sampling_params": {**GREEDY, "top_logprobs": TOP, "prompt_logprobs": TOP}},
        # Token ids with the media runs already expanded (as /v1/render returns them).
        "seeded": {"token_ids": p.token_ids, **case.media(), "sampling_params": sampled},
        "score": {"kind": "score", "token_ids": p.token_ids, **case.media(), "completion_token_ids": case.completion},
        # Two choices of one prompt (a GRPO group): one prefill, two seeded rows.
        "group": {"token_ids": p.token_ids, **case.media(), "sampling_params": {**SEEDED, "n": 2, "top_logprobs": TOP}},
    }


def _sglang_body(case: Case, *, stream: bool) -> dict:
    sampling = ({"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True} if stream else
                {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "sampling_seed": SEED, "ignore_eos": True})
    # Plain: input_ids (expanded); streamed: text with the placeholder (the service expands it).
    body = {"text": case.prompt.text} if stream else {"input_ids": case.prompt.token_ids}
    if case.modality != "text":
        body[SGLANG_MEDIA[case.modality]] = case.url
    return {**body, "sampling_params": sampling, "return_logprob": True, "top_logprobs_num": TOP,
            "logprob_start_len": SGLANG_STREAM_START if stream else 0, **({"stream": True} if stream else {})}


def _sglang_batch_body(cases: dict[str, Case]) -> dict:
    """One SGLang batch of every case's prompt, each media field a list with an entry per prompt."""
    body: dict[str, Any] = {"input_ids": [case.prompt.token_ids for case in cases.values()]}
    for modality, name in SGLANG_MEDIA.items():
        if modality in cases:
            body[name] = [case.url if m == modality else None for m, case in cases.items()]
    return {**body, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "sampling_seed": SEED,
                                        "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": TOP, "logprob_start_len": 0}


def _vllm_sampling() -> dict:
    return {**SEEDED, "logprobs": TOP, "prompt_logprobs": TOP}


def _chat_body(case: Case, model: str, *, stream: bool = False) -> dict:
    return {"model": model, "messages": case.messages(), **SEEDED, "logprobs": True, "top_logprobs": TOP,
            "return_token_ids": True, "return_tokens_as_token_ids": True, **({"stream": True} if stream else {})}


def _completion_bodies(case: Case, model: str) -> dict[str, dict]:
    ids = {"model": model, "prompt": case.prompt.token_ids, **SEEDED, "logprobs": TOP, "echo": True,
           "return_token_ids": True, "return_tokens_as_token_ids": True}
    text = {"model": model, "prompt": case.prompt.text, **GREEDY, "logprobs": TOP, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    return {"ids": ids, "text": text}


def _render_then_generate(caller: Caller, case: Case, model: str) -> dict:
    """vLLM's render, its token ids and features passed back to generate unchanged (SkyRL's way)."""
    rendered = caller.post("/v1/chat/completions/render", {"model": model, "messages": case.messages()})
    body = {"model": model, "token_ids": rendered["token_ids"], "sampling_params": _vllm_sampling()}
    if rendered.get("features"):
        body["features"] = rendered["features"]
    return {"render": rendered, "reply": caller.post("/inference/v1/generate", body)}


class Databases:
    """Where the stacks run: the databases in turn, each emptied first. A stack stops in the
    background while the next one starts on the other database (nothing of the stopping one can
    reach it), and a database is taken again only once its last stack has stopped."""

    def __init__(self, redis_url: str):
        self.redis_url = redis_url
        self.turn = 0
        self.stopping: dict[int, threading.Thread] = {}

    def take(self) -> tuple[int, str]:
        db = DBS[self.turn % len(DBS)]
        self.turn += 1
        self.wait(db)
        return db, empty_db_url(self.redis_url, db)

    def stop_later(self, db: int, context) -> None:
        thread = threading.Thread(target=context.__exit__, args=(None, None, None), name=f"stop-db-{db}")
        thread.start()
        self.stopping[db] = thread

    def wait(self, *dbs: int) -> None:
        for db in dbs or list(self.stopping):
            if (thread := self.stopping.pop(db, None)) is not None:
                thread.join()


def _serve(registered: str, directory, databases: Databases, loopback, tmp_path_factory) -> Served:
    from processors.registry import load_processor

    began = time.monotonic()
    processor = load_processor(directory)
    reference = MemoReference(directory, processor.hf)
    scored = processor.tokenizer(SCORED, add_special_tokens=False)["input_ids"]
    cases = {m: Case(m, make_prompt(processor, m, text=QUESTION), scored) for m in ("text", *sorted(processor.modalities))}
    replies = {m: Replies() for m in cases}
    name = "".join(c if c.isalnum() else "-" for c in registered)
    db, redis_url = databases.take()
    env = make_stack_env(redis_url=redis_url, model_dir=directory, state_dir=tmp_path_factory.mktemp(f"fidelity-{name}"),
                         loopback=loopback, ROLLOUT_CPU_CONCURRENCY="2")
    context = build_stack(env, loopback, log_dir_for(tmp_path_factory, f"fidelity-{name}-logs"),
                          workers=("cpu", "gpu", "batches"))
    stack = context.__enter__()
    try:
        _call_every_route(stack, cases, replies)
    except BaseException as error:
        context.__exit__(type(error), error, error.__traceback__)
        raise
    databases.stop_later(db, context)
    return Served(registered, reference, media_token_ids(reference.model.config), cases, replies,
                  time.monotonic() - began)


def _call_every_route(stack, cases: dict[str, Case], replies: dict[str, Replies]) -> None:
    """Every request of every case, at once where they can be; what each answered into ``replies``."""
    caller = Caller(stack)
    model = caller.get("/v1/models").get_json()["data"][0]["id"]

    # Batches first, their lines running beside the calls below. Ours (one upload), then OpenAI's
    # (a file per endpoint: a batch's lines all have its endpoint).
    ours = []
    for m, case in cases.items():
        bodies = _native_bodies(case)
        ours += [{"custom_id": f"{m}/generate", "kind": "generate", "body": bodies["seeded"]},
                 {"custom_id": f"{m}/score", "kind": "score", "body": bodies["score"]}]
    response = stack.client.post("/v1/batches", data=_jsonl(ours), content_type="application/jsonl",
                                 headers=HEADERS)
    assert response.status_code == 202, response.get_json()
    our_batch = response.get_json()["id"]
    openai_lines = {"/v1/jobs": [], "/v1/chat/completions": [], "/v1/completions": []}
    for m, case in cases.items():
        bodies = _native_bodies(case)
        openai_lines["/v1/jobs"] += [
            {"custom_id": f"{m}/generate", "method": "POST", "url": "/v1/jobs", "body": bodies["seeded"]},
            {"custom_id": f"{m}/score", "method": "POST", "url": "/v1/jobs", "body": bodies["score"]}]
        openai_lines["/v1/chat/completions"].append(
            {"custom_id": f"{m}/chat", "method": "POST", "url": "/v1/chat/completions",
             "body": _chat_body(case, model)})
        if m == "text":  # /v1/completions takes no media
            openai_lines["/v1/completions"].append(
                {"custom_id": f"{m}/completions", "method": "POST", "url": "/v1/completions",
                 "body": _completion_bodies(case, model)["ids"]})
    openai_batches = {}
    for endpoint, lines in openai_lines.items():
        uploaded = stack.client.post("/v1/files", data={"file": (io.BytesIO(_jsonl(lines)), "lines.jsonl"),
                                                        "purpose": "batch"},
                                     content_type="multipart/form-data", headers=HEADERS)
        assert uploaded.status_code == 200, uploaded.get_json()
        openai_batches[endpoint] = caller.post("/v1/batches", {
            "input_file_id": uploaded.get_json()["id"], "endpoint": endpoint, "completion_window": "24h"},
            status=202)["id"]

    # Native jobs, submitted at once; then every synchronous and streamed call in threads.
    # Those read through GET /v1/jobs/{id}/events say so: their tokens are written from the start.
    native_jobs = {m: {what: caller.post("/v1/jobs", {**body, "stream_events": what != "score"}, status=202)["id"]
                       for what, body in _native_bodies(case).items()} for m, case in cases.items()}
    calls = {}
    with ThreadPoolExecutor(max_workers=16) as pool:
        sglang_batch = pool.submit(caller.post, "/generate", _sglang_batch_body(cases))
        for m, case in cases.items():
            bodies = _native_bodies(case)
            calls[m, "events-greedy"] = pool.submit(caller.stream, f"/v1/jobs/{native_jobs[m]['greedy']}/events")
            calls[m, "events-seeded"] = pool.submit(caller.stream, f"/v1/jobs/{native_jobs[m]['seeded']}/events")
            calls[m, "sync-generate"] = pool.submit(caller.post, "/v1/generate", {**bodies["seeded"],
                                                                                  "timeout": 120})
            calls[m, "sync-score"] = pool.submit(caller.post, "/v1/generate", {**bodies["score"], "timeout": 120})
            calls[m, "sglang"] = pool.submit(caller.post, "/generate", _sglang_body(case, stream=False))
            calls[m, "sglang-stream"] = pool.submit(caller.stream, "/generate", _sglang_body(case, stream=True))
            vllm = {"token_ids": case.prompt.token_ids, **case.media(), "sampling_params": _vllm_sampling()}
            calls[m, "vllm"] = pool.submit(caller.post, "/inference/v1/generate", vllm)
            calls[m, "vllm-stream"] = pool.submit(caller.stream, "/inference/v1/generate", {**vllm, "stream": True})
            calls[m, "vllm-render"] = pool.submit(_render_then_generate, caller, case, model)
            calls[m, "chat"] = pool.submit(caller.post, "/v1/chat/completions", _chat_body(case, model))
            calls[m, "chat-stream"] = pool.submit(caller.stream, "/v1/chat/completions",
                                                  _chat_body(case, model, stream=True))
            if m == "text":  # /v1/completions takes no media
                completions = _completion_bodies(case, model)
                calls[m, "completions-ids"] = pool.submit(caller.post, "/v1/completions", completions["ids"])
                calls[m, "completions-text"] = pool.submit(caller.post, "/v1/completions", completions["text"])
                calls[m, "completions-stream"] = pool.submit(caller.stream, "/v1/completions",
                                                             {**completions["text"], "stream": True})
        for m, jobs in native_jobs.items():
            for what, job_id in jobs.items():
                replies[m][f"job-{what}"] = outcome(caller.job, job_id)
        for (m, route), future in calls.items():
            replies[m][route] = outcome(future.result)
        batch_replies = outcome(sglang_batch.result)
        for i, m in enumerate(cases):  # the replies in prompt order
            replies[m]["sglang-batch"] = batch_replies if isinstance(batch_replies, Failed) else batch_replies[i]

    # The jobs behind the dialect streams: their results, which the streams must equal.
    for m in cases:
        for route in ("sglang-stream", "vllm-stream", "chat-stream", "completions-stream"):
            if route in replies[m]:
                replies[m][f"{route}-job"] = outcome(_stream_job, caller, route, replies[m])

    # Batch results (output and error lines), by custom_id: a failed line fails its route only.
    caller.batch(our_batch)
    for which in ("output", "errors"):
        for line in _lines(caller.get(f"/v1/batches/{our_batch}/{which}")):
            m, what = line["custom_id"].split("/")
            replies[m][f"batch-{what}"] = line
    for batch_id in openai_batches.values():
        caller.batch(batch_id)
        view = caller.get(f"/v1/batches/{batch_id}?view=openai").get_json()
        for file_id in (view["output_file_id"], view["error_file_id"]):
            for line in _lines(caller.get(f"/v1/files/{file_id}/content")) if file_id else ():
                m, what = line["custom_id"].split("/")
                replies[m][f"openai-batch-{what}"] = line


def _lines(response) -> list[dict]:
    return [json.loads(text) for text in response.get_data(as_text=True).splitlines() if text.strip()]


def _stream_job(caller: Caller, route: str, replies: Replies) -> dict:
    """The job a dialect stream ran, as ``GET /v1/jobs/{id}`` shows it."""
    first = replies[route][0]["data"]
    if route == "sglang-stream":
        job_id = first["meta_info"]["job_id"]
    elif route == "vllm-stream":
        job_id = first["job_id"]
    else:
        job_id = "job_" + first["id"].split("-", 1)[1]  # cmpl-XXXX / chatcmpl-XXXX: the job's id
    return caller.job(job_id)


# --- reading each route's reply ------------------------------------------------------------------


def _token_id(spelled: str) -> int:
    assert spelled.startswith("token_id:"), spelled
    return int(spelled.removeprefix("token_id:"))


def _native_choice(route: str, result: dict, prompt_logprobs: bool) -> Seen:
    (choice,) = result["choices"]
    seen = Seen(route, result["prompt_token_ids"], choice["token_ids"], choice["logprobs"], top=choice["top_logprobs"])
    if prompt_logprobs:
        assert result["prompt_logprobs"][0] is None, f"{route}: the first prompt token has a logprob"
        seen.prompt_logprobs = result["prompt_logprobs"][1:]
        seen.prompt_shown = result["prompt_top_logprobs"][1:]
    return seen


def _native_choices(route: str, result: dict, n: int) -> list[Seen]:
    assert len(result["choices"]) == n, f"{route}: {len(result['choices'])} choices"
    return [_native_choice(f"{route} choice {choice['index']}", {**result, "choices": [choice]}, False)
            for choice in result["choices"]]


def _native_score(route: str, result: dict, completion: list[int]) -> Seen:
    assert "completion_logprobs" in result, f"{route}: no completion_logprobs in {sorted(result)}"
    return Seen(route, result["prompt_token_ids"], completion, result["completion_logprobs"])


def _events(route: str, events: list[dict]) -> list[Seen]:
    """The streamed tokens and logprobs equal the result's, and (through it) the model's."""
    assert events[-1]["event"] == "result", f"{route}: ends with {events[-1]['event']}"
    result = events[-1]["data"]["result"]
    ids, lps = [], []
    for event in events:
        if event["event"] == "tokens":
            for choice in event["data"]["choices"]:
                assert choice["offset"] == len(ids), f"{route}: a gap or repeat at offset {choice['offset']}"
                ids += choice["token_ids"]
                lps += choice["logprobs"]
    (choice,) = result["choices"]
    assert ids == choice["token_ids"], f"{route}: streamed tokens {ids}, the result's {choice['token_ids']}"
    assert lps == choice["logprobs"], f"{route}: streamed logprobs {lps}, the result's {choice['logprobs']}"
    return [Seen(route, result["prompt_token_ids"], ids, lps)]


def _sglang_reply(route: str, reply: dict, prompt: list[int] | None = None, start: int = 0) -> Seen:
    """SGLang's reply; its prompt ids are those of ``input_token_logprobs`` (from ``start``, the
    request's ``logprob_start_len``: before it, the ``prompt`` the job consumed)."""
    meta = reply["meta_info"]
    entries = meta["input_token_logprobs"]
    if start == 0:
        prompt = [entry[1] for entry in entries]
        assert entries[0][0] is None, f"{route}: the first prompt token has a logprob"
    else:
        assert [entry[1] for entry in entries] == prompt[start:], f"{route}: input_token_logprobs ids are not " \
                                                                  f"the prompt's from logprob_start_len"
    out = meta["output_token_logprobs"]
    assert [entry[1] for entry in out] == reply["output_ids"], f"{route}: output_token_logprobs ids != output_ids"
    # Prompt positions from the second, those before ``start`` as the reference's (not shown).
    first = max(start, 1)
    skip = first - start
    return Seen(route, prompt, reply["output_ids"], [entry[0] for entry in out],
                top=[[[t, lp] for lp, t, _ in step] for step in meta["output_top_logprobs"]],
                prompt_logprobs=[entry[0] for entry in entries[skip:]],
                prompt_shown=[[(t, lp) for lp, t, _ in step] for step in meta["input_top_logprobs"][skip:]],
                prompt_from=first)


def _sglang_stream(route: str, events: list[dict], job: dict) -> list[Seen]:
    chunks = [e["data"] for e in events]
    assert chunks[-1] == "[DONE]", f"{route}: ends with {chunks[-1]}"
    chunks = chunks[:-1]
    final = chunks[-1]
    result = job["result"]["choices"][0]
    for chunk in chunks:  # cumulative: each a prefix of the result
        streamed = chunk["meta_info"]["output_token_logprobs"]
        n = len(streamed)
        assert chunk["output_ids"] == result["token_ids"][:n], f"{route}: chunk ids not a prefix of the result's"
        assert [e[0] for e in streamed] == result["logprobs"][:n], f"{route}: chunk logprobs not the result's"
    assert final["output_ids"] == result["token_ids"], f"{route}: the last chunk is not the whole result"
    return [_sglang_reply(route, final, job["result"]["prompt_token_ids"], SGLANG_STREAM_START)]


def _vllm_choice(route: str, prompt: list[int], choice: dict, k: int) -> Seen:
    content = choice["logprobs"]["content"]
    ids = [_token_id(e["token"]) for e in content]
    assert ids == choice["token_ids"], f"{route}: logprobs.content tokens != token_ids"
    shown = []
    for token, entry in zip(ids, content, strict=True):
        alternatives = [(_token_id(a["token"]), a["logprob"]) for a in entry["top_logprobs"]]
        assert alternatives[0] == (token, entry["logprob"]), f"{route}: top_logprobs do not start with the token"
        assert len(alternatives) == max(k, 1), f"{route}: {len(alternatives)} top_logprobs for logprobs={k}"
        shown.append(alternatives[1:])  # the k - 1 most likely others
    return Seen(route, prompt, ids, [e["logprob"] for e in content], shown=shown, best=k - 1, others=True)


def _vllm_prompt(seen: Seen, prompt_logprobs: list) -> Seen:
    """vLLM's prompt_logprobs: per position ``{token_id: {logprob, rank, decoded_token}}`` holding
    the prompt token and the k most likely."""
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(seen.prompt), seen.route
    seen.prompt_logprobs = [step[str(token)]["logprob"] for token, step in zip(seen.prompt[1:], prompt_logprobs[1:],
                                                                                 strict=True)]
    seen.prompt_shown = [[(int(t), e["logprob"]) for t, e in step.items()] for step in prompt_logprobs[1:]]
    return seen


def _vllm_reply(route: str, reply: dict, prompt: list[int]) -> Seen:
    # The reply names no prompt ids unless it carries prompt_token_ids: the ids sent (runs expanded).
    prompt = reply.get("prompt_token_ids") or prompt
    return _vllm_prompt(_vllm_choice(route, prompt, reply["choices"][0], TOP), reply["prompt_logprobs"])


def _vllm_stream(route: str, events: list[dict], job: dict) -> list[Seen]:
    chunks = [e["data"] for e in events]
    assert chunks[-1] == "[DONE]", f"{route}: ends with {chunks[-1]}"
    ids, lps = [], []
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        ids += choice["token_ids"]
        content = (choice["logprobs"] or {"content": []})["content"]
        assert [_token_id(e["token"]) for e in content] == choice["token_ids"], f"{route}: chunk logprobs != its ids"
        lps += [e["logprob"] for e in content]
    return [_streamed(route, job, ids, lps)]


def _streamed(route: str, job: dict, ids: list[int], lps: list[float]) -> Seen:
    (choice,) = job["result"]["choices"]
    assert ids == choice["token_ids"], f"{route}: streamed tokens {ids}, the job's {choice['token_ids']}"
    assert lps == choice["logprobs"], f"{route}: streamed logprobs {lps}, the job's {choice['logprobs']}"
    return Seen(route, job["result"]["prompt_token_ids"], ids, lps)


def _chat_reply(route: str, reply: dict) -> Seen:
    (choice,) = reply["choices"]
    content = choice["logprobs"]["content"]
    ids = [_token_id(e["token"]) for e in content]
    assert ids == choice["token_ids"], f"{route}: logprobs.content tokens != token_ids"
    top = [[[_token_id(a["token"]), a["logprob"]] for a in e["top_logprobs"]] for e in content]
    return Seen(route, reply["prompt_token_ids"], ids, [e["logprob"] for e in content], top=top)


def _chat_stream(route: str, events: list[dict], job: dict) -> list[Seen]:
    chunks = [e["data"] for e in events]
    assert chunks[-1] == "[DONE]", f"{route}: ends with {chunks[-1]}"
    ids, lps = [], []
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            content = (choice["logprobs"] or {"content": []})["content"]
            assert [_token_id(e["token"]) for e in content] == choice.get("token_ids", []), route
            ids += choice.get("token_ids", [])
            lps += [e["logprob"] for e in content]
    return [_streamed(route, job, ids, lps)]


def _completion_reply(route: str, reply: dict, echo: bool) -> Seen:
    (choice,) = reply["choices"]
    logprobs = choice["logprobs"]
    prompt, ids = choice["prompt_token_ids"], choice["token_ids"]
    spelled = [_token_id(t) for t in logprobs["tokens"]]
    at = len(prompt) if echo else 0
    assert spelled == ([*prompt, *ids] if echo else ids), f"{route}: logprobs.tokens are not the ids"
    steps = [[(_token_id(t), lp) for t, lp in (step or {}).items()] for step in logprobs["top_logprobs"]]
    # The dict holds the sampled token and the k most likely.
    for token, lp, step in zip(spelled[at:], logprobs["token_logprobs"][at:], steps[at:], strict=True):
        assert (token, lp) in step, f"{route}: top_logprobs lack the sampled token"
    seen = Seen(route, prompt, ids, logprobs["token_logprobs"][at:], shown=steps[at:])
    if echo:
        assert logprobs["token_logprobs"][0] is None, f"{route}: the first prompt token has a logprob"
        seen.prompt_logprobs = logprobs["token_logprobs"][1:at]
        seen.prompt_shown = steps[1:at]
    return seen


def _completion_stream(route: str, events: list[dict], job: dict) -> list[Seen]:
    chunks = [e["data"] for e in events]
    assert chunks[-1] == "[DONE]", f"{route}: ends with {chunks[-1]}"
    ids, lps = [], []
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            if choice["logprobs"] is None:
                continue
            assert [_token_id(t) for t in choice["logprobs"]["tokens"]] == choice["token_ids"], route
            ids += choice["token_ids"]
            lps += choice["logprobs"]["token_logprobs"]
    return [_streamed(route, job, ids, lps)]


def _batch_body(route: str, line: dict) -> dict:
    assert line.get("error") is None and line["response"]["status_code"] == 200, f"{route}: {line}"
    return line["response"]["body"]


def observations(served: Served, modality: str) -> tuple[list[Seen], list[str]]:
    """Every route's numbers for ``modality``, and the routes whose replies could not be read."""
    case = served.cases[modality]
    r = served.replies[modality]
    prompt, scored = case.prompt.token_ids, case.completion
    readers = [
        ("POST /v1/jobs greedy", lambda route: [_native_choice(route, r["job-greedy"]["result"], True)]),
        ("POST /v1/jobs seeded", lambda route: [_native_choice(route, r["job-seeded"]["result"], True)]),
        ("POST /v1/jobs n=2", lambda route: _native_choices(route, r["job-group"]["result"], 2)),
        ("POST /v1/jobs score", lambda route: [_native_score(route, r["job-score"]["result"], scored)]),
        ("POST /v1/generate", lambda route: [_native_choice(route, r["sync-generate"], True)]),
        ("POST /v1/generate score", lambda route: [_native_score(route, r["sync-score"], scored)]),
        ("GET /v1/jobs/{id}/events greedy", lambda route: _events(route, r["events-greedy"])),
        ("GET /v1/jobs/{id}/events seeded", lambda route: _events(route, r["events-seeded"])),
        ("batch (ours) generate line", lambda route: [_native_choice(route, _batch_body(route, r["batch-generate"]),
                                                                     True)]),
        ("batch (ours) score line", lambda route: [_native_score(route, _batch_body(route, r["batch-score"]),
                                                                 scored)]),
        ("OpenAI batch /v1/jobs generate line", lambda route: [_native_choice(
            route, _batch_body(route, r["openai-batch-generate"]), True)]),
        ("OpenAI batch /v1/jobs score line", lambda route: [_native_score(
            route, _batch_body(route, r["openai-batch-score"]), scored)]),
        ("OpenAI batch /v1/chat/completions line", lambda route: [_chat_reply(
            route, _batch_body(route, r["openai-batch-chat"]))]),
        ("SGLang /generate", lambda route: [_sglang_reply(route, r["sglang"])]),
        ("SGLang /generate batch", lambda route: [_sglang_reply(route, r["sglang-batch"])]),
        ("SGLang /generate stream", lambda route: _sglang_stream(route, r["sglang-stream"], r["sglang-stream-job"])),
        ("vLLM /inference/v1/generate", lambda route: [_vllm_reply(route, r["vllm"], prompt)]),
        ("vLLM /inference/v1/generate stream", lambda route: _vllm_stream(route, r["vllm-stream"],
                                                                          r["vllm-stream-job"])),
        ("vLLM render + /inference/v1/generate", lambda route: [_vllm_reply(
            route, r["vllm-render"]["reply"], r["vllm-render"]["render"]["token_ids"])]),
        ("OpenAI /v1/chat/completions", lambda route: [_chat_reply(route, r["chat"])]),
        ("OpenAI /v1/chat/completions stream", lambda route: _chat_stream(route, r["chat-stream"],
                                                                          r["chat-stream-job"])),
    ]
    if modality == "text":  # /v1/completions takes no media
        readers += [
            ("OpenAI /v1/completions (ids, echo)", lambda route: [_completion_reply(route, r["completions-ids"],
                                                                                    True)]),
            ("OpenAI /v1/completions (text)", lambda route: [_completion_reply(route, r["completions-text"], False)]),
            ("OpenAI /v1/completions stream", lambda route: _completion_stream(route, r["completions-stream"],
                                                                               r["completions-stream-job"])),
            ("OpenAI batch /v1/completions line", lambda route: [_completion_reply(
                route, _batch_body(route, r["openai-batch-completions"]), True)]),
        ]
    seen, problems = [], []
    for route, read in readers:
        try:
            seen += read(route)
        except (AssertionError, KeyError, TypeError, ValueError) as error:
            problems.append(f"{route}: {type(error).__name__}: {error}")
    return seen, problems


# --- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fidelity_dirs(tmp_path_factory):
    return demo_dirs(tmp_path_factory.mktemp("fidelity-route-models"))


@pytest.fixture(scope="module")
def served(fidelity_dirs, redis_url, loopback_host, tmp_path_factory):
    """``served(registered)``: the architecture's stack run once (or the error it failed with)."""
    runs: dict[str, Served | BaseException] = {}
    databases = Databases(redis_url)

    def get(registered: str) -> Served:
        if registered not in runs:
            directory = demo_dir_for(fidelity_dirs, registered)
            try:
                runs[registered] = _serve(registered, directory, databases, loopback_host, tmp_path_factory)
            except Exception as error:  # every test of the architecture reports it, none starts it again
                runs[registered] = error
        run = runs[registered]
        if isinstance(run, BaseException):
            raise run
        return run

    yield get
    databases.wait()


@pytest.mark.parametrize(("registered", "modality"), CASES)
def test_every_route_returns_the_models_own_logprobs(registered, modality, served):
    run = served(registered)
    seen, problems = observations(run, modality)
    items = run.cases[modality].prompt.items
    report = [f"{registered} {modality} (its stack: {run.seconds:.1f} s)"]
    for one in seen:
        try:
            report.append(f"  {one.route:<45} worst {check(one, run.reference, items, run.media_ids):.1e}")
        except AssertionError as error:
            problems.append(str(error))
    print("\n".join(report))  # the measured differences: pytest -rP
    assert not problems, f"{registered} {modality}: {len(problems)} problems:\n" + "\n".join(problems)
