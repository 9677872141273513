"""The API process never imports torch: it reads the model's config and tokenizer through
``domain/model_probe.py``, and a fresh interpreter proves it (the test process holds torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from domain.model_probe import load_tokenizer, probe_here
from tests.conftest import empty_db_url
from tests.web.conftest import KEY_A

ROOT = Path(__file__).resolve().parents[2]

# Builds the API and calls each route that reads the model's config or tokenizer.
API_SCRIPT = """
import json, sys
from web.app import create_app
from domain.settings import Settings

model, redis_url, state, key = sys.argv[1:5]
app = create_app(Settings(state_dir=state, model=model, api_keys=(key,)), redis_url)
client, auth = app.test_client(), {"Authorization": f"Bearer {key}"}
calls = [
    ("/v1/jobs", {"prompt": "hello there", "sampling_params": {"max_new_tokens": 2}}),
    ("/tokenize", {"prompt": "hello there"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
    ("/v1/completions/render", {"model": model, "prompt": "hello there"}),
]
answers = [client.post(path, json=body, headers=auth) for path, body in calls]
print(json.dumps({"status": [a.status_code for a in answers], "tokens": answers[1].get_json()["tokens"],
                  "torch": "torch" in sys.modules}))
"""


def _run_api_script(model_dir, redis_url, state_dir) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", API_SCRIPT, str(model_dir), redis_url, str(state_dir), KEY_A],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_api_serves_model_routes_without_importing_torch(demo_model_dir, redis_url, tmp_path):
    url = empty_db_url(redis_url, 2)
    first = _run_api_script(demo_model_dir, url, tmp_path)
    assert first["torch"] is False
    assert first["status"] == [202, 200, 200, 200, 200]
    tokenizer = load_tokenizer(str(demo_model_dir), probe_here(str(demo_model_dir)).tokenizer_class)
    assert first["tokens"] == tokenizer("hello there")["input_ids"]  # the same tokens a worker makes
    assert list((tmp_path / "model-probes").glob("*.json")), "the probe is cached for the next API process"
    assert _run_api_script(demo_model_dir, url, tmp_path) == first
