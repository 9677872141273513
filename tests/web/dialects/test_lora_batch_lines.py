"""Batch lines that name a LoRA adapter run under it (#58 item 2): resolved for the uploading key
when the file is read (the lines run later, without the HTTP request), an unknown name refused per
line as its route would; never the base's answer."""

from __future__ import annotations

import io

from tests.web.api.test_adapters_api import adapter_dir
from tests.web.api.test_batches_api import jsonl
from tests.web.conftest import KEY_B, auth
from tests.web.dialects.test_openai_batches_api import create, model_name, request_line, upload_file
from workers.tasks.batches import submit_chunk


def test_lines_naming_an_adapter_carry_its_id_and_an_unknown_one_is_a_404(make_app, tmp_path):
    adapter_dir(tmp_path / "root" / "tuned", r=4)  # no GPU worker: the load answers at once
    client = make_app(weights_root=tmp_path / "root").test_client()
    loaded = client.post("/v1/adapters", json={"name": "tuned", "path": "tuned"}, headers=auth())
    assert loaded.status_code == 200, loaded.get_json()
    adapter_id = loaded.get_json()["id"]
    chat = {"model": "tuned", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    data = jsonl(request_line("chat", "/v1/chat/completions", chat),
                 request_line("base", "/v1/chat/completions", {**chat, "model": model_name(client)}),
                 request_line("unknown", "/v1/chat/completions", {**chat, "model": "other"}))
    response = create(client, upload_file(client, data))
    assert response.status_code == 202, response.get_json()
    batch = response.get_json()
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [(3, "model_not_found")]
    svc = client.application.extensions["rollout"]
    submit_chunk(svc, batch["id"], 0)
    jobs = svc.batches.line_jobs(batch["id"], [1, 2])
    tuned, base = svc.jobs.get(jobs[1])["request"], svc.jobs.get(jobs[2])["request"]
    assert (tuned.get("adapter"), tuned.get("lora_id")) == ("tuned", adapter_id)
    assert "lora_id" not in base

    # Another key's line naming it: refused, as its request would be.
    other = client.post("/v1/files", data={"file": (io.BytesIO(jsonl(request_line("theirs", "/v1/chat/completions",
                                                                                chat))), "in.jsonl"),
                                           "purpose": "batch"}, content_type="multipart/form-data", headers=auth(KEY_B))
    refused = client.post("/v1/batches", json={"input_file_id": other.get_json()["id"],
                                               "endpoint": "/v1/chat/completions", "completion_window": "24h"},
                          headers=auth(KEY_B))
    assert refused.status_code == 422  # its one line refused: no valid line
    assert [e["error"]["code"] for e in refused.get_json()["errors"]] == ["model_not_found"]
