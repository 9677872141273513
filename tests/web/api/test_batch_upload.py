"""A batch file's chat lines are checked a chunk at a time, their prompts tokenized in one call per
chunk (web/api/batch_upload.py): every line's stored job request is, byte for byte, the one the
synchronous /v1/chat/completions route builds, its token ids are transformers' own
``apply_chat_template``'s, and a refused line is refused alone, wherever it sits in its chunk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import redis
from flask import g
from transformers import AutoTokenizer

from domain.settings import Settings
from tests.web.api.test_batches_api import jsonl, line
from web.api import batch_upload
from web.api.batch_upload import validate_lines
from web.api.submit import check_limits
from web.app import create_app
from web.dialects import openai
from web.dialects.common import served_model_name, token_ids_of, tokenizer
from web.dialects.openai.batch_lines import CHAT_URL, begin_line, finish_line
from web.services import services

PNG = "data:image/png;base64,iVBORw0KGgo="  # intake checks the reference only: nothing is fetched
CHUNK = 4  # several chunks in every file here, the last one partial

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"},
     {"role": "user", "content": "Now backwards, then forwards again please."}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "What is the weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
    [{"role": "user", "name": "ann", "content": "  leading and trailing spaces  \n\n"}],
    [{"role": "user", "content": "Unicode: naïve café, 東京, emoji 🎲, tabs\tand\nnewlines."}],
    [{"role": "user", "content": "<|im_start|> typed by the user <|im_end|> is a special token"}],
    [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": " both."}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}},
                                  {"type": "text", "text": "What is in the picture?"}]}],
    [{"role": "system", "content": "Compare."},
     {"role": "user", "content": [{"type": "image_url", "image_url": PNG, "uuid": "a"},
                                  {"type": "image_url", "image_url": {"url": PNG}},
                                  {"type": "text", "text": "Same?"}]},
     {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Sure?"}],
    [{"role": "user", "content": " ".join(f"w{i % 97}" for i in range(300))}],
]
# Body options that change the prompt or the request, one set per line in turn.
OPTIONS = [{}, {"add_generation_prompt": False}, {"add_special_tokens": True},
           {"chat_template_kwargs": {"add_vision_id": True}}, {"max_completion_tokens": 3, "logprobs": True,
                                                               "top_logprobs": 2, "seed": 7}]


@pytest.fixture(params=["demo", "bos"])
def model_dir(request, demo_model_dir, tmp_path_factory) -> Path:
    """The demo model, and a copy whose tokenizer adds a BOS (the demo's adds no special token, so
    only this one shows that ``add_special_tokens`` reaches the batched call)."""
    if request.param == "demo":
        return demo_model_dir
    copy = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(demo_model_dir, copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    bos = next(token for token in spec["added_tokens"] if token["content"] == "<|endoftext|>")
    spec["post_processor"]["single"].insert(0, {"SpecialToken": {"id": bos["content"], "type_id": 0}})
    spec["post_processor"]["special_tokens"] = {bos["content"]: {"id": bos["content"], "ids": [bos["id"]],
                                                                 "tokens": [bos["content"]]}}
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    return copy


@pytest.fixture
def app(model_dir, web_redis_url, tmp_path, monkeypatch):
    monkeypatch.setattr(batch_upload, "LINES_PER_CHUNK", CHUNK)
    redis.Redis.from_url(web_redis_url).flushdb()
    app = create_app(Settings(state_dir=tmp_path, model=str(model_dir), api_keys=("key",)), web_redis_url)
    # Lines are checked inside an authenticated upload: the caller's key names its adapters.
    with app.test_request_context(headers={"Authorization": "Bearer key"}):
        g.owner = services().keys.authenticate()
        yield app


@pytest.fixture
def model(app) -> str:
    return served_model_name()


def chat_line(custom_id: str, model: str, messages: list[dict], **options) -> dict:
    limit = {} if "max_completion_tokens" in options else {"max_tokens": 4}
    body = {"model": model, "messages": messages, **limit, **options}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}


def varied_lines(model: str) -> list[dict]:
    return [chat_line(f"c{i}", model, messages, **OPTIONS[i % len(OPTIONS)])
            for i, messages in enumerate(CONVERSATIONS * 2)]


def sync_route_request(body: dict) -> dict:
    """What POST /v1/chat/completions submits for ``body`` (web/dialects/openai/views.py)."""
    return check_limits(openai.chat_request(openai.ChatCompletionRequestSchema().load(body)))


def test_batched_chat_lines_store_the_sync_routes_job_requests(app, model):
    lines = varied_lines(model)
    parsed = validate_lines(jsonl(*lines), max_lines=1000, endpoint=CHAT_URL)
    assert parsed.invalid == [] and parsed.total == len(lines) == len(parsed.valid)
    bos = tokenizer()("", add_special_tokens=True)["input_ids"]
    special = [json.loads(stored)["request"]["token_ids"][:len(bos)]
               for obj, stored in zip(lines, parsed.valid, strict=True) if obj["body"].get("add_special_tokens")]
    assert special and all(ids == bos for ids in special)  # the tokenizer's own special tokens, where asked
    for number, (obj, stored) in enumerate(zip(lines, parsed.valid, strict=True), start=1):
        request = sync_route_request(obj["body"])
        custom_id, _, reply = finish_line(begin_line(obj, CHAT_URL), request["token_ids"])
        expected = {"line": number, "custom_id": custom_id, "request": request, "reply": reply}
        assert stored == json.dumps(expected, separators=(",", ":")), obj


def test_batched_token_ids_are_transformers_apply_chat_template(app, model, model_dir):
    hf = AutoTokenizer.from_pretrained(model_dir)
    lines = [obj for obj in varied_lines(model) if "add_special_tokens" not in obj["body"]]
    parsed = validate_lines(jsonl(*lines), max_lines=1000, endpoint=CHAT_URL)
    for obj, stored in zip(lines, parsed.valid, strict=True):
        body = obj["body"]
        template_messages, _ = openai.chat_messages(body["messages"])
        expected = hf.apply_chat_template(template_messages, tokenize=True, return_dict=False,
                                          add_generation_prompt=body.get("add_generation_prompt", True),
                                          **body.get("chat_template_kwargs", {}))
        assert json.loads(stored)["request"]["token_ids"] == expected, obj


def test_a_refused_line_is_refused_alone_wherever_it_sits_in_its_chunk(app, model):
    ok = [{"role": "user", "content": "fine"}]
    data = jsonl(
        chat_line("a", model, ok),                                          # 1 valid
        chat_line("b", model, [{"role": 3, "content": "x"}]),               # 2 refused before tokenizing
        chat_line("c", model, ok, max_tokens=-1),                           # 3 refused once tokenized
        chat_line("d", "not-the-model", ok),                                # 4 404
        "{not json",                                                        # 5
        chat_line("c", model, ok),                                          # 6 valid: line 3 never claimed "c"
        chat_line("a", model, ok),                                          # 7 duplicate of line 1
        chat_line("e", model, ok, max_tokens=10**6),                        # 8 refused by the limits
        chat_line("f", model, [{"role": "user", "content": [{"type": "audio"}]}]),  # 9 bad part
        line("native"),                                                     # 10 not the endpoint
        chat_line("g", model, CONVERSATIONS[9]),                            # 11 valid, with an image
    )
    parsed = validate_lines(data, max_lines=1000, endpoint=CHAT_URL)
    assert [(e["line"], e["custom_id"], e["error"]["code"], e.get("status_code")) for e in parsed.invalid] == [
        (2, "b", "invalid_request", 422), (3, "c", "invalid_request", 422), (4, "d", "model_not_found", 404),
        (5, None, "invalid_json", None), (7, "a", "duplicate_custom_id", None),
        (8, "e", "context_length_exceeded", 422), (9, "f", "invalid_request", 422),
        (10, "native", "endpoint_mismatch", None)]
    stored = [json.loads(entry) for entry in parsed.valid]
    assert [(entry["line"], entry["custom_id"]) for entry in stored] == [(1, "a"), (6, "c"), (11, "g")]
    assert stored[2]["request"] == sync_route_request(chat_line("g", model, CONVERSATIONS[9])["body"])
    assert stored[2]["request"]["content_parts"] == [{"type": "image_url", "url": PNG}]


@pytest.mark.parametrize("left_set", ["truncation", "padding", "split_special_tokens"])
def test_batched_ids_are_the_tokenizers_own_call_whatever_is_left_set_on_it(app, left_set):
    """transformers' call resets what a tokenizer may carry (truncation, padding, how special
    tokens split); the batched path must give what that call gives, not the backend's raw ids."""
    tok = tokenizer()
    texts = ["<|im_start|>user\nHello there, how are you today?<|im_end|>\n", "short", ""]
    if left_set == "truncation":
        tok.backend_tokenizer.enable_truncation(max_length=3)
    elif left_set == "padding":
        tok.backend_tokenizer.enable_padding(length=64)
    else:
        tok.split_special_tokens = True
    batched = token_ids_of(texts, add_special_tokens=False)
    assert batched == [tok(text, add_special_tokens=False)["input_ids"] for text in texts]


def test_a_line_holding_an_integer_past_64_bits_is_stored_as_json_writes_it(app):
    # orjson writes every line but refuses such an integer (domain/infra/finite_json.compact).
    huge = 2**70 + 1
    obj = {"custom_id": "big", "kind": "generate",
           "body": {"token_ids": [1, 2], "metadata": {"step": huge}, "sampling_params": {"max_tokens": 2}}}
    parsed = validate_lines(jsonl(obj), max_lines=10)
    assert parsed.invalid == []
    (stored,) = parsed.valid
    assert json.loads(stored)["request"]["metadata"] == {"step": huge}
