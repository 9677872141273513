"""A GPU worker whose model fails the load-time fidelity check takes no work: it exits (code 3)
with the reason in its log, /healthz and /get_model_info say why, and its jobs wait, untouched, for
a worker whose model passes, which then serves them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import empty_db_url
from tests.e2e.conftest import ROOT, build_stack, log_dir_for, make_stack_env


def test_a_model_that_fails_the_check_takes_no_work_and_says_why(redis_url, demo_model_dir, loopback_host,
                                                                 tmp_path_factory):
    env = make_stack_env(redis_url=empty_db_url(redis_url, 31), model_dir=demo_model_dir,
                         state_dir=tmp_path_factory.mktemp("model-check-state"), loopback=loopback_host)
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, "model-check"), workers=("cpu",)) as stack:
        job = stack.submit({"prompt": "The quick brown fox", "sampling_params": {"max_tokens": 2, "temperature": 0}})
        refused = subprocess.run([sys.executable, "-m", "tests.e2e.perturbed_gpu_worker"], cwd=ROOT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1", **env}, capture_output=True,
                                 text=True, timeout=120)
        assert refused.returncode == 3, refused.stderr[-3000:]
        assert "the engine's logprobs are not the model's own" in refused.stderr
        assert "exiting without taking work" in refused.stderr

        health = stack.client.get("/healthz")
        assert health.status_code == 503
        body = health.get_json()
        assert body["model"] == "down" and body["model_error"]["code"] == "model_fidelity_failed"
        assert body["model_error"]["report"]["scoring_max_diff"] > body["model_error"]["report"]["tolerance"]
        info = stack.client.get("/get_model_info", headers=stack.headers()).get_json()
        assert info["model_check"]["passed"] is False
        # The job was never taken: still waiting for a GPU worker (preprocessed), not failed.
        record = stack.client.get(f"/v1/jobs/{job['id']}", headers=stack.headers()).get_json()
        assert record["status"] in ("queued", "preprocessing") and record["error"] is None, record

        stack.start("gpu")
        stack.wait_ready(["gpu"])
        done = stack.wait(job["id"])
        assert done["status"] == "succeeded" and len(done["result"]["choices"][0]["token_ids"]) == 2
        assert stack.client.get("/healthz").get_json().get("model_error") is None
        assert stack.client.get("/get_model_info", headers=stack.headers()).get_json()["model_check"]["passed"]
