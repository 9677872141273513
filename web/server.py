"""Serving the API under gunicorn (a production WSGI server)."""

from __future__ import annotations

from gunicorn.app.base import BaseApplication

from workers.settings import Settings


class ApiServer(BaseApplication):
    def __init__(self, settings: Settings, redis_url: str):
        self.settings = settings
        self.redis_url = redis_url
        super().__init__()

    def load_config(self):
        s = self.settings
        self.cfg.set("bind", f"{s.host}:{s.port}")
        self.cfg.set("workers", s.api_workers)
        # Threads: POST /v1/generate and the dialect routes wait for their jobs, and a waiting request must not hold a process.
        self.cfg.set("worker_class", "gthread")
        self.cfg.set("threads", 16)
        self.cfg.set("timeout", int(s.sync_timeout_max) + 30)
        self.cfg.set("graceful_timeout", 5)
        self.cfg.set("accesslog", None)
        self.cfg.set("loglevel", s.log_level.lower())

    def load(self):
        from web.app import create_app

        return create_app(self.settings, self.redis_url)
