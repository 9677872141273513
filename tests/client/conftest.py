"""A scripted loopback HTTP server for the client's tests."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

# --- A scripted server ----------------------------------------------------------------------------

class Scripted:
    """Answers each request with the next scripted (status, headers, body); records what came."""

    def __init__(self):
        self.script: deque = deque()
        self.seen: list[tuple[float, str, str, bytes]] = []
        self.headers: list[dict[str, str]] = []  # each request's, in the order of seen
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                scripted.seen.append((time.monotonic(), self.command, self.path, body))
                scripted.headers.append(dict(self.headers))
                status, headers, payload = scripted.script.popleft() if len(scripted.script) > 1 else scripted.script[0]
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for name, value in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def gaps(self) -> list[float]:
        times = [seen[0] for seen in self.seen]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@pytest.fixture
def scripted():
    server = Scripted()
    yield server
    server.server.shutdown()
    server.server.server_close()
