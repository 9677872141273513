"""Processor fixtures: a tiny model of every registered architecture, the real fetcher (images
travel as data: URLs), the real inline transport and a multimodal cache on the session's Redis
(the isolated redis-server started by tests/conftest.py)."""

from __future__ import annotations

import base64
import uuid

import pytest
import torch

from engine.demo_model import ARCHS, build_demo_model
from engine.limits import Limits
from engine.transport import InlineTransport, open_feature
from processors.cache import MultimodalCache
from processors.fetch import FetchPolicy, GuardedFetcher
from processors.registry import load_processor
from tests.media_files import mp4_bytes, png_bytes, wav_bytes

torch.set_num_threads(1)

@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("processor-models")
    return {arch: build_demo_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def processors(model_dirs):
    return {arch: load_processor(directory) for arch, directory in model_dirs.items()}


@pytest.fixture(scope="session")
def models(model_dirs):
    """Models loaded on first use (not every test needs one)."""
    from transformers import AutoModelForMultimodalLM

    loaded = {}

    def get(arch):
        if arch not in loaded:
            loaded[arch] = AutoModelForMultimodalLM.from_pretrained(model_dirs[arch]).eval()
        return loaded[arch]

    return get


@pytest.fixture(scope="session")
def fetcher():
    return GuardedFetcher(FetchPolicy())


@pytest.fixture(scope="session")
def transport():
    return InlineTransport()


@pytest.fixture
def limits():
    return Limits()


@pytest.fixture
def cache(redis_client):
    cache = MultimodalCache(redis_client, max_bytes=64 * 1024 * 1024, namespace=f"test:{uuid.uuid4().hex}")
    yield cache
    cache.clear()


@pytest.fixture(scope="session")
def image_url():
    """``image_url(width, height, seed)``: a data: URL of a noise PNG (seeded, so repeatable)."""

    def make(width: int = 64, height: int = 48, seed: int = 0) -> str:
        return "data:image/png;base64," + base64.b64encode(png_bytes(width, height, seed)).decode()

    return make


@pytest.fixture(scope="session")
def open_items():
    """Open the items' transport handles, as the GPU side does; the items keep their handles."""

    def open_(items):
        from dataclasses import replace

        return [replace(item, features={k: open_feature(v) for k, v in item.features.items()}) for item in items]

    return open_


@pytest.fixture(scope="session")
def video_url():
    """``video_url(frames, width, height, seed)``: a data: URL of a noise mp4 at 2 fps."""

    def make(frames: int = 4, width: int = 64, height: int = 48, seed: int = 0) -> str:
        return "data:video/mp4;base64," + base64.b64encode(mp4_bytes(frames, width, height, seed)).decode()

    return make


@pytest.fixture(scope="session")
def audio_url():
    """``audio_url(seconds, rate, seed)``: a data: URL of a mono WAV."""

    def make(seconds: float = 1.0, rate: int = 16_000, seed: int = 0) -> str:
        return "data:audio/wav;base64," + base64.b64encode(wav_bytes(seconds, rate, seed)).decode()

    return make
