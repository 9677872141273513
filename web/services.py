"""What the views need, built once per app from settings and kept in ``app.extensions``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import redis
from celery import Celery
from flask import current_app

from web.auth import KeyRing
from workers.celery_app import create_celery
from workers.job_events import JobEvents
from workers.job_store import JobStore, Limits
from workers.models import ModelFacts, model_facts, model_id, resolve_model_path
from workers.redis_client import connect, with_pool_size
from workers.runtime import multimodal_cache
from workers.settings import Settings


@dataclass
class Services:
    settings: Settings
    redis: redis.Redis
    jobs: JobStore
    celery: Celery
    keys: KeyRing
    model_path: str
    model_facts: ModelFacts

    @classmethod
    def build(cls, settings: Settings, redis_url: str) -> Services:
        client = connect(redis_url)
        limits = Limits(settings.max_queued_per_key, settings.max_queued_total, settings.result_ttl,
                        settings.stream_events_maxlen)
        model_path = resolve_model_path(settings)
        return cls(settings, client, JobStore(client, limits), create_celery(settings, redis_url),
                   KeyRing(settings.api_keys, settings.admin_keys), model_path, model_facts(model_path))

    @property
    def max_model_len(self) -> int | None:
        return self.settings.max_model_len or self.model_facts.context_length

    # The model's processor gives the API its tokenizer and chat template (dialect routes), and the
    # cache lets SGLang's /flush_cache empty it; both built on first use so the API starts fast.
    # Media are never fetched here: rendering runs on a CPU worker (web/render.py).
    @cached_property
    def processor(self):
        from processors.registry import load_processor

        return load_processor(self.model_path, model_id=model_id(self.settings))

    @cached_property
    def webhooks(self):
        """Webhook deliveries, as the API shows them."""
        from workers.webhooks import WebhookStore

        return WebhookStore(self.redis, self.settings.result_ttl)

    @cached_property
    def stream_slots(self):
        from web.streams import StreamSlots

        return StreamSlots(self.settings.api_stream_slots)

    @cached_property
    def events(self) -> JobEvents:
        # Every stream blocks in a read on its own connection: a pool sized for the stream slots.
        client = with_pool_size(self.redis, self.settings.api_stream_slots + 16)
        return JobEvents(client, ttl=self.settings.result_ttl, maxlen=self.settings.stream_events_maxlen)

    @cached_property
    def mm_cache(self):
        return multimodal_cache(self.settings, self.redis)


def services() -> Services:
    return current_app.extensions["rollout"]
