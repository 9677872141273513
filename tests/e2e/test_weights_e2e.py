"""Weight updates through the whole stack: two GPU workers on two nodes, one Redis.

Every update runs under load (long greedy jobs decoding on both workers) and checks, per mode:
every job ends exactly once (one webhook each), its result says which weights made it, and its
tokens equal those of a fresh stack started on those weights (greedy, so reproducible):

- finish: the rows in flight finish on the old weights;
- abort: they end now with ``finish_reason: "abort"`` and a prefix of the old weights' tokens;
- retract: they run again from the prompt and their whole result is the new weights';
- keep: they go on under the new weights from where they were, their weight_versions spans split
  where the update landed, the tokens before it the old weights' own.

Plus: a bad directory changes nothing, a GPU worker killed during an update comes back on the
target, and a Redis restart in the middle of an update loses neither the target nor a job.
"""

from __future__ import annotations

import threading
import time

import pytest
from safetensors.torch import load_file, save_file

from domain.infra.redis_server import EmbeddedRedis, free_port
from engine.demo_model import build_demo_model
from tests.e2e.conftest import OTHER_KEY, build_stack, log_dir_for, make_stack_env
from tests.e2e.job_checks import assert_one_webhook_each, statuses, submit_all, wait_until

ADMIN = "e2e-admin-key"
HOOK_PATH = "/hooks/weights"
MAX_TOKENS = 500
# Token ids >= 100 are plain text on the demo model (no CPU worker needed); equal lengths, no padding.
LONG = [{"token_ids": [100 + i, 140, 150, 160],
         "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}} for i in range(8)]


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-root")
    build_demo_model(root / "step-1", seed=1)
    build_demo_model(root / "step-2", seed=2)
    # Headers fine (the API's check passes), a NaN inside: every worker refuses it.
    poisoned = build_demo_model(root / "poisoned", seed=3)
    tensors = load_file(poisoned / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, poisoned / "model.safetensors", metadata={"format": "pt"})
    build_demo_model(root / "other-arch", arch="llava")
    return root


def _env(redis_url, model_dir, state_dir, loopback, weights_root, **extra):
    return make_stack_env(
        redis_url=redis_url, model_dir=model_dir, state_dir=state_dir, loopback=loopback, node_id="wnode-a",
        ROLLOUT_ADMIN_KEYS=ADMIN, ROLLOUT_WEIGHTS_ROOT=str(weights_root), ROLLOUT_WEIGHTS_UPDATE_TIMEOUT="90",
        ROLLOUT_VISIBILITY_TIMEOUT="20", ROLLOUT_TASK_TIME_LIMIT="15", ROLLOUT_TASK_SOFT_TIME_LIMIT="12",
        ROLLOUT_WEBHOOK_RETRY_SCHEDULE="0.5,1,1,2,2,2", ROLLOUT_LOG_LEVEL="INFO", **extra)


@pytest.fixture(scope="module")
def fresh_tokens(weights_root, loopback_host, tmp_path_factory):
    """Greedy tokens of LONG from a fresh stack started on each weights directory."""
    tokens = {}
    server = EmbeddedRedis(tmp_path_factory.mktemp("fresh-redis"), persistent=False).start()
    try:
        for name in ("step-1", "step-2"):
            env = _env(server.url, weights_root / name, tmp_path_factory.mktemp(f"fresh-{name}"), loopback_host,
                       weights_root, ROLLOUT_NODE_ID=f"fresh-{name}")
            with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, f"fresh-{name}"),
                             workers=("gpu",)) as fresh:
                ids = [fresh.submit(body)["id"] for body in LONG]
                tokens[name] = [fresh.wait(job_id, timeout=120)["result"]["choices"][0]["token_ids"] for job_id in ids]
    finally:
        server.stop()
    return tokens


@pytest.fixture(scope="module")
def weights_redis(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("weights-redis"), port=free_port(), persistent=True).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet(weights_redis, demo_model_dir, weights_root, loopback_host, tmp_path_factory):
    env = _env(weights_redis.url, demo_model_dir, tmp_path_factory.mktemp("weights-state"), loopback_host,
               weights_root)
    node_b = {"ROLLOUT_NODE_ID": "wnode-b", "ROLLOUT_STATE_DIR": str(tmp_path_factory.mktemp("wnode-b"))}
    loopback_host.route(HOOK_PATH, (200, {}, b""))
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "weights"),
                     workers=("gpu", ("gpu-b", "gpu", node_b), "webhooks")) as stack:
        yield stack


def admin(stack):
    return stack.headers(ADMIN)


def update(stack, name: str, version: str, mode: str = "finish", expect: int = 200) -> dict:
    response = stack.client.post("/v1/weights", json={"model_path": name, "weight_version": version, "mode": mode},
                                 headers=admin(stack))
    assert response.status_code == expect, response.get_json()
    return response.get_json()


def ended_once(stack, ids, timeout: float = 120.0) -> list[dict]:
    """The jobs once ended, asserting each ended exactly once (one webhook delivery each)."""
    done = [stack.wait(job_id, timeout=timeout) for job_id in ids]
    assert_one_webhook_each(stack.host, ids, HOOK_PATH)
    return done


def serving(stack) -> dict[str, str]:
    state = stack.client.get("/v1/weights", headers=admin(stack)).get_json()
    return {w["node"]: (w["state"], w["version"]) for w in state["workers"]}


def tokens_of(job) -> list[int]:
    return job["result"]["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", ["finish", "abort", "retract"])
def test_an_update_under_load(fleet, fresh_tokens, mode):
    start = update(fleet, "step-2", f"{mode}-old")  # a known start: both workers on step-2
    assert start["success"] and {w["version"] for w in start["workers"]} == {f"{mode}-old"}
    assert len(start["workers"]) == 2
    in_flight = submit_all(fleet, LONG, HOOK_PATH)
    wait_until(lambda: "generating" in statuses(fleet, in_flight), 60, "a batch decoding")

    report = update(fleet, "step-1", f"{mode}-new", mode)
    after = submit_all(fleet, LONG, HOOK_PATH)  # submitted once the call answered: new weights only

    assert report["success"] and serving(fleet) == {"wnode-a": ("serving", f"{mode}-new"),
                                                    "wnode-b": ("serving", f"{mode}-new")}
    done = ended_once(fleet, in_flight + after)
    first, later = done[:len(LONG)], done[len(LONG):]
    assert all(job["status"] == "succeeded" for job in done), [(j["status"], j.get("error")) for j in done]
    assert [tokens_of(job) for job in later] == fresh_tokens["step-1"]
    assert {job["result"]["weight_version"] for job in later} == {f"{mode}-new"}
    info = fleet.client.get("/get_model_info", headers=admin(fleet)).get_json()  # what SGLang's trainers read
    assert info["weight_version"] == f"{mode}-new"
    # A job of the first group was either in a batch when the update came (what the mode decides)
    # or still waiting for one (then it ran on the new weights, like the later group).
    old, new = fresh_tokens["step-2"], fresh_tokens["step-1"]
    stopped = 0
    for job, old_tokens, new_tokens in zip(first, old, new, strict=True):
        choice, version = job["result"]["choices"][0], job["result"]["weight_version"]
        if version == f"{mode}-new":
            assert choice["token_ids"] == new_tokens and choice["finish_reason"] == "length"
            continue
        assert version == f"{mode}-old" and mode != "retract"  # retracted rows never end on old weights
        if mode == "finish":
            assert choice["token_ids"] == old_tokens and choice["finish_reason"] == "length"
        else:
            assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < MAX_TOKENS
            assert choice["token_ids"] == old_tokens[:len(choice["token_ids"])]
            stopped += 1
    in_batch = sum(job["result"]["weight_version"] == f"{mode}-old" for job in first)
    if mode == "finish":
        assert in_batch >= 1 and report["num_paused_requests"] == 0
    elif mode == "abort":
        assert stopped == in_batch >= 1 and report["num_paused_requests"] == stopped
    else:
        assert report["num_paused_requests"] >= 1  # rows were retracted, and ran again on new weights


def test_an_update_in_mode_keep_under_load(fleet, fresh_tokens):
    start = update(fleet, "step-2", "keep-old")
    assert start["success"] and len(start["workers"]) == 2
    in_flight = submit_all(fleet, LONG, HOOK_PATH)
    wait_until(lambda: "generating" in statuses(fleet, in_flight), 60, "a batch decoding")

    report = update(fleet, "step-1", "keep-new", "keep")
    assert report["success"] and report["num_paused_requests"] >= 1  # the rows held for the swap
    done = ended_once(fleet, in_flight)
    assert all(job["status"] == "succeeded" for job in done), [(j["status"], j.get("error")) for j in done]
    kept = 0
    for job, old_tokens, new_tokens in zip(done, fresh_tokens["step-2"], fresh_tokens["step-1"], strict=True):
        choice = job["result"]["choices"][0]
        assert choice["finish_reason"] == "length" and job["result"]["weight_version"] == "keep-new"
        spans = choice["weight_versions"]
        if len(spans) == 1:  # still waiting for a batch at the update: wholly the new weights'
            assert spans == [{"version": "keep-new", "start": 0, "end": MAX_TOKENS}]
            assert choice["token_ids"] == new_tokens and choice["kv_recomputed"] is None
            continue
        first, second = spans
        at = first["end"]
        assert first == {"version": "keep-old", "start": 0, "end": at} and 0 < at < MAX_TOKENS
        assert second == {"version": "keep-new", "start": at, "end": MAX_TOKENS}
        assert choice["token_ids"][:at] == old_tokens[:at] and choice["kv_recomputed"] is False
        kept += 1
    assert kept >= 1


def test_a_bad_directory_changes_nothing(fleet, fresh_tokens):
    update(fleet, "step-1", "good")
    refused = update(fleet, "other-arch", "never", expect=422)
    assert refused["code"] == "weights_invalid" and refused["errors"]["problem"] == "architecture_mismatch"
    poisoned = update(fleet, "poisoned", "never", expect=422)  # passes the API's check; every worker refuses
    assert poisoned["code"] == "weights_refused" and poisoned["errors"]["problem"] == "non_finite"
    state = fleet.client.get("/v1/weights", headers=admin(fleet)).get_json()
    assert state["target"]["version"] == "good"
    wait_until(lambda: serving(fleet) == {"wnode-a": ("serving", "good"), "wnode-b": ("serving", "good")}, 10,
               "both workers serving the previous weights")
    [job] = ended_once(fleet, submit_all(fleet, LONG[:1], HOOK_PATH))
    assert tokens_of(job) == fresh_tokens["step-1"][0] and job["result"]["weight_version"] == "good"


def test_a_gpu_worker_killed_during_an_update_comes_back_on_the_target(fleet, fresh_tokens):
    update(fleet, "step-2", "before-kill")
    in_flight = submit_all(fleet, LONG, HOOK_PATH)
    wait_until(lambda: "generating" in statuses(fleet, in_flight), 60, "a batch decoding")
    answer = {}
    call = threading.Thread(target=lambda: answer.update(update(fleet, "step-1", "after-kill", "finish")))
    call.start()  # finish: both workers are busy with their batch, the update waits for them
    wait_until(lambda: fleet.services.redis.hget("rq:weights:target", "version") == b"after-kill", 10, "target set")
    fleet.kill("gpu-b")
    fleet.start("gpu-b", "gpu")
    call.join(120)
    fleet.wait_ready(["gpu-b"])
    assert answer["success"]
    wait_until(lambda: serving(fleet) == {"wnode-a": ("serving", "after-kill"), "wnode-b": ("serving", "after-kill")},
               30, "the restarted worker on the target")
    done = ended_once(fleet, in_flight)
    for job, old, new in zip(done, fresh_tokens["step-2"], fresh_tokens["step-1"], strict=True):
        # The killed worker's jobs ran again on the new weights; the others finished on the old ones.
        expected = {"before-kill": old, "after-kill": new}[job["result"]["weight_version"]]
        assert job["status"] == "succeeded" and tokens_of(job) == expected


def test_a_redis_restart_in_the_middle_of_an_update(fleet, weights_redis, fresh_tokens):
    update(fleet, "step-1", "before-restart")
    in_flight = submit_all(fleet, LONG, HOOK_PATH)
    wait_until(lambda: "generating" in statuses(fleet, in_flight), 60, "a batch decoding")
    answer = {}
    call = threading.Thread(target=lambda: answer.update(update(fleet, "step-2", "after-restart", "retract")))
    call.start()
    wait_until(lambda: fleet.services.redis.hget("rq:weights:target", "version") == b"after-restart", 10, "target set")
    weights_redis.stop()
    time.sleep(2)
    weights_redis.start()  # same port, same append-only file
    call.join(120)
    assert answer["success"], answer
    done = ended_once(fleet, in_flight)
    assert {job["status"] for job in done} == {"succeeded"}
    for job, old, new in zip(done, fresh_tokens["step-1"], fresh_tokens["step-2"], strict=True):
        expected = {"before-restart": old, "after-restart": new}[job["result"]["weight_version"]]
        assert tokens_of(job) == expected


def test_only_admin_keys_and_paths_under_the_root(fleet, weights_root, demo_model_dir):
    body = {"model_path": "step-1", "weight_version": "x"}
    assert fleet.client.post("/v1/weights", json=body, headers=fleet.headers()).status_code == 403
    assert fleet.client.post("/v1/weights", json=body, headers=fleet.headers(OTHER_KEY)).status_code == 403
    for path in (str(demo_model_dir), "../x", "step-1/../../y"):
        response = fleet.client.post("/v1/weights", json={**body, "model_path": path}, headers=admin(fleet))
        assert response.status_code == 422 and response.get_json()["code"] == "weights_path_refused", path
