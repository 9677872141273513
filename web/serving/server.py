"""Serving the API under gunicorn (a production WSGI server)."""

from __future__ import annotations

from gunicorn import util
from gunicorn.app.base import BaseApplication
from gunicorn.workers.gthread import ThreadWorker

from domain.settings import Settings
from web.api.batch_upload import MULTIPART_OVERHEAD
from web.serving.early_errors import error_response
from web.serving.request_buffering import RequestBuffering
from web.serving.thread_share import digests


class _ErrorCapture:
    """The client socket as gunicorn's error writer sees it: what it writes is kept, not sent."""

    def __init__(self, sock):
        self._sock = sock
        self.written = b""

    def gettimeout(self) -> float:
        return 0.0  # non-blocking already: the writer need not switch the real socket

    def sendall(self, data: bytes) -> None:
        self.written += data

    def __getattr__(self, name):
        return getattr(self._sock, name)


class JsonErrorWorker(ThreadWorker):
    """gunicorn's threaded worker, answering the errors it finds itself (a request line past
    ``limit_request_line``, a NUL in a header, ...) in our error shape instead of HTML.

    gunicorn has no setting for its error pages. Its own ``handle_error`` still decides status
    and logging; only the HTML it writes is swapped for JSON (``web/serving/early_errors.py``).
    """

    def handle_error(self, req, client, addr, exc):
        capture = _ErrorCapture(client)
        super().handle_error(req, capture, addr, exc)
        status_line = capture.written.split(b"\r\n", 1)[0].decode("latin-1")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            return
        response = error_response(int(parts[1]), status_line, limit=self.cfg.limit_request_line)
        try:
            util.write_nonblock(client, response)
        except Exception:
            self.log.debug("Failed to send error message.")


class ApiWorker(RequestBuffering, JsonErrorWorker):
    """What the API runs: gthread that reads whole requests in its event loop before a thread takes
    them (``web/serving/request_buffering.py``) and answers its own errors in our JSON shape."""


class ApiServer(BaseApplication):
    def __init__(self, settings: Settings, redis_url: str):
        self.settings = settings
        self.redis_url = redis_url
        super().__init__()

    def load_config(self):
        s = self.settings
        self.cfg.set("bind", f"{s.host}:{s.port}")
        self.cfg.set("workers", s.api_workers)
        # Threads: POST /v1/generate and the dialect routes wait for their jobs, and a waiting request
        # must not hold a process. ApiWorker: whole requests before threads (slow clients cost a
        # socket, not a thread), gunicorn's own errors in our JSON shape.
        # SSE streams (web/api/streams.py) run on threads of their own: api_stream_slots more threads,
        # each parked in a blocking Redis read that releases the GIL, and a stream past the slots
        # is refused (503), so streams never take the api_threads ordinary requests run on. gthread
        # times a worker by its main loop's heartbeat, not by request, so a stream of minutes is fine.
        threads = s.api_threads + s.api_stream_slots
        # One key holds all but half the ordinary threads (its streams have their own slots), so
        # other keys always find some; the open demo has one caller: it may hold every thread.
        keyed = bool(s.api_keys or s.admin_keys)
        self.cfg.set("worker_class", type("ApiWorker", (ApiWorker,), {
            "read_timeout": s.request_read_timeout, "write_timeout": s.stream_write_timeout,
            "first_byte_timeout": s.request_first_byte_timeout, "connections_per_peer": s.api_connections_per_peer,
            "max_body_bytes": max(s.max_body_bytes, s.batch_max_bytes + MULTIPART_OVERHEAD),
            "per_key_threads": threads - max(1, s.api_threads // 2) if keyed else None,
            "known_keys": digests(s.api_keys + s.admin_keys), "admin_keys": digests(s.admin_keys)}))
        self.cfg.set("threads", threads)
        # Twice one peer's cap at least: a peer at its cap leaves room for every other.
        self.cfg.set("worker_connections", max(1000, 2 * threads, 2 * s.api_connections_per_peer))
        self.cfg.set("timeout", int(s.sync_timeout_max) + 30)
        # gunicorn closes an idle kept-alive connection after 2 s by default, and a pooled client
        # that sends as it closes gets a closed socket (1 bulk post in ~100 sent 2 s apart failed so).
        # Clients keep idle connections longer (httpx 5 s, aiohttp 15 s, Go 90 s; requests, with
        # no limit, sees a closed one before reuse unless the close crosses its send), and a load
        # balancer in front should close first (AWS ALB: 60 s): 120 s outlasts them. An idle
        # connection costs a socket in the event loop, not a thread; past worker_connections -
        # threads of them a reply closes its connection instead. A close can still cross a send:
        # submits carry an Idempotency-Key and the client sends them again (web/api/idempotency.py).
        self.cfg.set("keepalive", s.api_keepalive_seconds)
        self.cfg.set("graceful_timeout", 5)
        self.cfg.set("accesslog", None)
        self.cfg.set("loglevel", s.log_level.lower())

    def load(self):
        from web.app import create_app

        return closing_after_413(create_app(self.settings, self.redis_url))


def closing_after_413(app):
    """A 413 leaves the rest of the body unread, so the connection cannot carry another request:
    the reply says ``Connection: close`` and gunicorn closes it. gunicorn drops an application's
    own Connection header (hop-by-hop); its response's ``force_close`` is the way, and the
    ``start_response`` it hands the application is bound to that response."""

    def wsgi(environ, start_response):
        def start(status, headers, exc_info=None):
            if status.startswith("413"):
                response = getattr(start_response, "__self__", None)
                if hasattr(response, "force_close"):
                    response.force_close()
            return start_response(status, headers, exc_info)

        return app(environ, start)

    return wsgi
