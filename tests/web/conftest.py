from __future__ import annotations

import pytest
import redis

from domain.settings import Settings
from tests.conftest import db_url
from web.app import create_app

KEY_A = "key-a-secret"
KEY_B = "key-b-secret"


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """The built-in Qwen3 chat demo (tool calls, reasoning) the agent routes' tests serve, built once."""
    from engine.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("models") / "demo-qwen3", arch="qwen3_tools")


@pytest.fixture
def web_redis_url(redis_url) -> str:
    return db_url(redis_url, 2)


@pytest.fixture
def redis_client(web_redis_url):
    """API tests look at the database their app uses."""
    client = redis.Redis.from_url(web_redis_url)
    yield client
    client.close()


@pytest.fixture
def make_app(web_redis_url, demo_model_dir, tmp_path):
    """Build the API with test settings (no workers: jobs stay queued)."""
    url = web_redis_url

    def make(**overrides):
        redis.Redis.from_url(url).flushdb()
        settings = Settings(state_dir=tmp_path, model=str(demo_model_dir), **{"api_keys": (KEY_A, KEY_B), **overrides})
        app = create_app(settings, url)
        app.config["TESTING"] = True
        return app

    return make


@pytest.fixture
def client(make_app):
    return make_app().test_client()


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
