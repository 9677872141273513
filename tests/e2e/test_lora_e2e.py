"""LoRA adapters per key through the whole stack (#58 items 1-3): a real API, Redis and two GPU
workers.

Loaded by vLLM's, SGLang's and the native routes from a directory under the weights root, chosen
by ``model`` (OpenAI / vLLM), ``lora_path`` (SGLang) or ``adapter`` (native); tokens and logprobs
equal PEFT's own forward; another key neither lists nor uses a key's adapter; an admin's is shared;
a bad adapter is refused and changes nothing; unloaded, a request naming it is a 404, never the
base's answer. Updated in place in mode keep (item 5), its running jobs go on under the new version,
their ``weight_versions`` naming the version of each token."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from domain.adapters.store import AdapterRegistry
from domain.infra.redis_server import EmbeddedRedis
from tests.e2e.conftest import API_KEY, OTHER_KEY, build_stack, log_dir_for, make_stack_env
from tests.e2e.job_checks import statuses, wait_until
from tests.engine.lora.lora_support import make_adapter, peft_reference
from tests.fidelity import assert_close

ADMIN = "e2e-lora-admin"
PROMPT = [300, 301, 302, 303, 304]
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True}


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, demo_model_dir):
    root = tmp_path_factory.mktemp("lora-root")
    make_adapter(demo_model_dir, root / "tuned", rank=4, alpha=8, seed=1)
    make_adapter(demo_model_dir, root / "other", rank=2, alpha=4, seed=2, suffixes=("q_proj", "v_proj"))
    make_adapter(demo_model_dir, root / "tuned-step-2", rank=4, alpha=8, seed=7)  # the trainer's next step
    poisoned = make_adapter(demo_model_dir, root / "poisoned", rank=2, alpha=4, seed=3)
    tensors = load_file(poisoned / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, poisoned / "adapter_model.safetensors")
    return root


@pytest.fixture(scope="module")
def stack(weights_root, demo_model_dir, loopback_host, tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("lora-redis"), persistent=False).start()
    env = make_stack_env(redis_url=server.url, model_dir=demo_model_dir, state_dir=tmp_path_factory.mktemp("lora"),
                         loopback=loopback_host, node_id="lora-node", ROLLOUT_ADMIN_KEYS=ADMIN,
                         ROLLOUT_WEIGHTS_ROOT=str(weights_root), ROLLOUT_WEIGHTS_UPDATE_TIMEOUT="60",
                         ROLLOUT_MAX_LORAS_PER_KEY="2")
    try:
        # Two GPU workers on two nodes: a load answers once both serve it, and either may run a request.
        node_b = {"ROLLOUT_NODE_ID": "lora-node-b", "ROLLOUT_STATE_DIR": str(tmp_path_factory.mktemp("lora-b"))}
        with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "lora"),
                         workers=("gpu", ("gpu-b", "gpu", node_b))) as built:
            yield built
    finally:
        server.stop()


def post(stack, path, body, key=API_KEY):
    return stack.client.post(path, json=body, headers=stack.headers(key))


def native(stack, key=API_KEY, **extra):
    response = post(stack, "/v1/generate", {"token_ids": PROMPT, "sampling_params": GREEDY, **extra}, key)
    return response


def choice_of(response):
    assert response.status_code == 200, response.get_json()
    return response.get_json()["choices"][0]


def made(response) -> tuple:
    """What a choice's weights made: its tokens and logprobs (its spans name the adapter's id)."""
    choice = choice_of(response)
    return choice["token_ids"], choice["logprobs"]


def test_load_choose_on_every_route_and_unload(stack, demo_model_dir, weights_root):
    loaded = post(stack, "/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": "tuned"})
    assert loaded.status_code == 200, loaded.get_data(as_text=True)
    assert "added successfully" in loaded.get_data(as_text=True)
    workers = AdapterRegistry(stack.services.redis).workers()
    assert len(workers) == 2 and all(len(w.ids) == 1 for w in workers), "both GPU workers serve it when it answers"

    models = stack.client.get("/v1/models", headers=stack.headers()).get_json()["data"]
    served = models[0]["id"]
    assert [(m["id"], m["parent"]) for m in models[1:]] == [("tuned", served)]
    assert [m["id"] for m in stack.client.get("/v1/models", headers=stack.headers(OTHER_KEY)).get_json()["data"]] \
        == [served], "another key does not see this key's adapter"

    tuned, base = choice_of(native(stack, adapter="tuned")), choice_of(native(stack))
    want = peft_reference(demo_model_dir, weights_root / "tuned").token_logprobs(PROMPT, tuned["token_ids"])
    assert_close(tuned["logprobs"], want, "the adapter's logprobs through the API")
    assert_close(base["logprobs"], peft_reference(demo_model_dir, None).token_logprobs(PROMPT, base["token_ids"]),
                 "the base's")

    completion = post(stack, "/v1/completions", {"model": "tuned", "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True, "logprobs": 0, "return_token_ids": True})
    assert completion.status_code == 200, completion.get_json()
    assert completion.get_json()["model"] == "tuned", "vLLM's replies name the adapter"
    [answer] = completion.get_json()["choices"]
    assert answer["token_ids"] == tuned["token_ids"]
    assert answer["logprobs"]["token_logprobs"] == pytest.approx(tuned["logprobs"], abs=1e-6)

    sglang = post(stack, "/generate", {"input_ids": PROMPT, "lora_path": "tuned", "return_logprob": True,
                                       "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert sglang.status_code == 200, sglang.get_json()
    assert [item[1] for item in sglang.get_json()["meta_info"]["output_token_logprobs"]] == tuned["token_ids"]

    other = post(stack, "/v1/completions", {"model": "tuned", "prompt": PROMPT, "max_tokens": 1}, OTHER_KEY)
    assert other.status_code == 404 and other.get_json()["error"]["code"] == "model_not_found"
    assert native(stack, OTHER_KEY, adapter="tuned").get_json()["code"] == "adapter_not_found"

    unloaded = post(stack, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert unloaded.status_code == 200, unloaded.get_data(as_text=True)
    gone = post(stack, "/v1/completions", {"model": "tuned", "prompt": PROMPT, "max_tokens": 1})
    assert gone.status_code == 404 and gone.get_json()["error"]["code"] == "model_not_found"
    assert native(stack, adapter="tuned").status_code == 404
    again = post(stack, "/v1/unload_lora_adapter", {"lora_name": "tuned"})
    assert again.status_code == 404 and again.get_json()["error"]["code"] == "adapter_not_found"


def test_a_bad_adapter_is_refused_and_the_served_ones_stay(stack):
    assert post(stack, "/v1/adapters", {"name": "kept", "path": "other"}).status_code == 200
    before = choice_of(native(stack, adapter="kept"))
    refused = post(stack, "/v1/adapters", {"name": "kept", "path": "poisoned", "load_inplace": True})
    assert refused.status_code == 422, refused.get_json()
    assert refused.get_json()["code"] == "adapter_invalid"
    assert refused.get_json()["errors"]["problem"] == "non_finite"
    outside = post(stack, "/v1/adapters", {"name": "out", "path": "/etc"})
    assert outside.status_code == 422 and outside.get_json()["code"] == "weights_path_refused"
    assert choice_of(native(stack, adapter="kept")) == before
    listed = stack.client.get("/v1/adapters", headers=stack.headers()).get_json()["data"]
    assert [(a["name"], a["shared"]) for a in listed] == [("kept", False)]
    assert stack.client.delete("/v1/adapters/kept", headers=stack.headers()).status_code == 200
    assert stack.client.get("/v1/adapters", headers=stack.headers()).get_json()["data"] == []


def test_per_key_cap_same_names_per_key_and_shared_adapters(stack):
    for name in ("one", "two"):
        assert post(stack, "/v1/adapters", {"name": name, "path": "other"}).status_code == 200
    capped = post(stack, "/v1/adapters", {"name": "three", "path": "other"})
    assert capped.status_code == 409 and capped.get_json()["code"] == "adapter_limit_reached"
    # Another key loads its own "one": each key's requests run under its own.
    assert post(stack, "/v1/adapters", {"name": "one", "path": "tuned"}, OTHER_KEY).status_code == 200
    assert made(native(stack, adapter="one")) != made(native(stack, OTHER_KEY, adapter="one"))
    # SGLang's load: an admin's adapter is every key's.
    shared = post(stack, "/load_lora_adapter", {"lora_name": "common", "lora_path": "tuned"}, ADMIN)
    assert shared.status_code == 200 and shared.get_json()["success"], shared.get_json()
    assert made(native(stack, OTHER_KEY, adapter="common")) == made(native(stack, OTHER_KEY, adapter="one"))
    for key, name in ((API_KEY, "one"), (API_KEY, "two"), (OTHER_KEY, "one")):
        assert stack.client.delete(f"/v1/adapters/{name}", headers=stack.headers(key)).status_code == 200
    assert post(stack, "/unload_lora_adapter", {"lora_name": "common"}, ADMIN).get_json()["success"]


KEEP_TOKENS = 400


def test_an_update_in_mode_keep_carries_running_jobs_over(stack):
    old = post(stack, "/v1/adapters", {"name": "policy", "path": "tuned"})
    assert old.status_code == 200, old.get_json()
    sampling = {"max_tokens": KEEP_TOKENS, "temperature": 0, "ignore_eos": True}
    fresh = choice_of(post(stack, "/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling,
                                                   "adapter": "policy"}))["token_ids"]  # the old version alone
    ids = [stack.submit({"token_ids": PROMPT, "sampling_params": sampling, "adapter": "policy"})["id"]
           for _ in range(2)]
    wait_until(lambda: statuses(stack, ids) == ["generating"] * 2, 60, "both jobs decoding")

    new = post(stack, "/v1/adapters", {"name": "policy", "path": "tuned-step-2", "load_inplace": True,
                                       "mode": "keep"})
    assert new.status_code == 200 and new.get_json()["mode"] == "keep", new.get_json()
    old_id, new_id = old.get_json()["id"], new.get_json()["id"]
    kept = 0
    for job_id in ids:
        job = stack.wait(job_id, timeout=120)
        assert job["status"] == "succeeded", job.get("error")
        [choice] = job["result"]["choices"]
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == KEEP_TOKENS
        spans = choice["weight_versions"]
        if len(spans) == 1:  # it had no token yet at the update: wholly the new version's
            assert spans[0]["adapter"] == new_id
            continue
        first, second = spans
        at = first["end"]
        assert (first["adapter"], first["start"], second["adapter"], second["start"], second["end"]) \
            == (old_id, 0, new_id, at, KEEP_TOKENS) and 0 < at < KEEP_TOKENS
        assert choice["token_ids"][:at] == fresh[:at], "the tokens before the update are the old version's"
        kept += 1
    assert kept >= 1, "no job was running at the update"
    assert stack.client.delete("/v1/adapters/policy", headers=stack.headers()).status_code == 200
