"""The stack's API served over real HTTP on loopback, for clients that speak a dialect."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from werkzeug.serving import make_server

from web.app import create_app


@contextmanager
def serve(stack, **settings):
    """A base URL serving an app on the stack's settings (with ``settings`` changed)."""
    app = create_app(stack.services.settings.replace(**settings), stack.env["ROLLOUT_REDIS_URL"])
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", app
    finally:
        server.shutdown()
        thread.join(5)
