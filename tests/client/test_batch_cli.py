"""The batch commands (rollout_queue_client/batch_cli.py) against a scripted loopback server: their defaults
come from the client's settings, their answers go to stdout, what the user can fix exits 2."""

from __future__ import annotations

import json

from rollout_queue_client.batch_cli import run
from rollout_queue_client.settings import DEFAULT_URL, ClientSettings

BATCH = {"id": "batch_1", "object": "batch", "status": "in_progress",
         "request_counts": {"total": 2, "completed": 1, "failed": 0}}


def test_settings_read_the_environment_given():
    assert ClientSettings.from_env({}) == ClientSettings(DEFAULT_URL, None)
    assert ClientSettings.from_env({"ROLLOUT_URL": "http://10.0.0.5:8000", "ROLLOUT_API_KEY": "k1"}) == \
        ClientSettings("http://10.0.0.5:8000", "k1")
    assert ClientSettings.from_env({"ROLLOUT_URL": "", "ROLLOUT_API_KEY": ""}) == ClientSettings(DEFAULT_URL, None)


def test_status_uses_the_settings_url_and_key(scripted, capsys):
    scripted.script.append((200, {}, BATCH))
    assert run(["status", "batch_1"], ClientSettings(scripted.url, "key-1")) == 0
    assert json.loads(capsys.readouterr().out) == BATCH
    assert [seen[1:3] for seen in scripted.seen] == [("GET", "/v1/batches/batch_1")]


def test_a_refusal_is_one_line_and_exit_status_2(scripted, capsys):
    scripted.script.append((404, {}, {"code": "not_found", "message": "no batch 'batch_x'"}))
    assert run(["cancel", "batch_x", "--url", scripted.url], ClientSettings("http://127.0.0.1:9", None)) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollout-queue: error:") and "no batch" in err and len(err.splitlines()) == 1
