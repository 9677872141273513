"""The stack the agent e2e files share: one GPU worker serving the built-in Qwen3 chat demo
(``demo-qwen3``: tool calls, reasoning) on Redis db 17, which those files and the fidelity routes'
stacks take in turn (each empties it first), and an OpenAI client of the API on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import openai

from domain.models import resolve_model_path
from domain.settings import Settings
from tests.conftest import empty_db_url
from tests.e2e.conftest import API_KEY, build_stack, log_dir_for, make_stack_env

CHAT_DEMO_DB = 17


@contextmanager
def chat_demo_stack(redis_url: str, loopback_host, tmp_path_factory, name: str) -> Iterator:
    state = tmp_path_factory.mktemp(f"{name}-state")
    model = resolve_model_path(Settings(state_dir=state, demo_model="demo-qwen3"))
    env = make_stack_env(redis_url=empty_db_url(redis_url, CHAT_DEMO_DB), model_dir=model, state_dir=state,
                         loopback=loopback_host)
    with build_stack(env, loopback_host, log_dir_for(tmp_path_factory, name), workers=("gpu",)) as built:
        yield built


def openai_client(url: str) -> openai.OpenAI:
    """The openai package's client of the API at ``url``, as a trainer builds it (no retries)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
