"""Loopback servers that count what reaches them, a scripted resolver and a connection spy.

Layout of the test network:
  * ``servers.public``   127.0.0.1:P  — the one address the test policies allow (allow_networks
    127.0.0.1/32, allowed_ports (P,)); "media.test" resolves here.
  * ``servers.internal`` 127.0.0.2:P  — stands for an internal service on the same port: if the
    guard ever let a loopback spelling through, the request would land here and be counted.
  * ``servers.internal6`` [::1]:P when the machine has IPv6 loopback, else None.
"""

from __future__ import annotations

import io
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import urllib3.util.connection
from PIL import Image

from processors.fetch import FetchPolicy, GuardedFetcher

Handler = Callable[[BaseHTTPRequestHandler], None]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: int = socket.AF_INET):
        self.address_family = family
        self.routes: dict[str, Handler] = {}
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        super().__init__(address, _Dispatch)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def count(self) -> int:
        return len(self.seen)

    def reset(self) -> None:
        with self._lock:
            self.routes = {}
            self.seen = []

    def route(self, path: str, handler: Handler) -> None:
        self.routes[path] = handler

    def reply(self, path: str, status: int = 200, body: bytes = b"", headers: dict | None = None) -> None:
        self.route(path, lambda req: respond(req, status, body, headers))

    def redirect(self, path: str, location: str, status: int = 302) -> None:
        self.route(path, redirect_raw(location, status))

    # For tests that write their own handlers.
    respond = staticmethod(lambda req, status, body=b"", headers=None: respond(req, status, body, headers))

    def record(self, req: BaseHTTPRequestHandler) -> Handler:
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else b""
        path = req.path.split("?", 1)[0]
        with self._lock:
            self.seen.append(Seen(req.command, req.path, dict(req.headers.items()), body))
        return self.routes.get(path, lambda r: respond(r, 404, b"not found"))

    def handle_error(self, request, client_address) -> None:
        pass  # clients hang up on purpose (caps, deadlines)


class _Dispatch(BaseHTTPRequestHandler):
    def _any(self) -> None:
        handler = self.server.record(self)  # type: ignore[attr-defined]
        try:
            handler(self)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = do_PUT = _any

    def log_message(self, *args: object) -> None:
        pass


def respond(req: BaseHTTPRequestHandler, status: int, body: bytes = b"", headers: dict | None = None) -> None:
    req.send_response(status)
    headers = {"Content-Length": str(len(body)), **(headers or {})}
    for name, value in headers.items():
        if value is not None:
            req.send_header(name, value)
    req.end_headers()
    req.wfile.write(body)


def redirect_raw(location: str, status: int = 302) -> Handler:
    """A redirect whose Location goes out byte for byte (send_header only takes latin-1)."""

    def handler(req: BaseHTTPRequestHandler) -> None:
        req.close_connection = True
        req.wfile.write(
            f"HTTP/1.1 {status} Moved\r\n".encode()
            + b"Location: "
            + location.encode("utf-8", "surrogateescape")
            + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )

    return handler


@dataclass
class Servers:
    public: CountingServer
    internal: CountingServer
    internal6: CountingServer | None

    @property
    def port(self) -> int:
        return self.public.port

    def internal_count(self) -> int:
        return self.internal.count + (self.internal6.count if self.internal6 else 0)


@pytest.fixture(scope="session")
def _servers() -> Servers:
    for _ in range(20):
        public = CountingServer(("127.0.0.1", 0))
        try:
            internal = CountingServer(("127.0.0.2", public.port))
        except OSError:
            public.shutdown()
            public.server_close()
            continue
        try:
            internal6 = CountingServer(("::1", public.port), socket.AF_INET6)
        except OSError:
            internal6 = None
        return Servers(public, internal, internal6)
    raise RuntimeError("could not bind the same port on 127.0.0.1 and 127.0.0.2")


@pytest.fixture(scope="session")
def start_server() -> Callable[..., CountingServer]:
    """Starts another counting server (e.g. one behind TLS); the caller shuts it down."""
    return CountingServer


@pytest.fixture
def servers(_servers: Servers) -> Servers:
    for s in (_servers.public, _servers.internal, _servers.internal6):
        if s is not None:
            s.reset()
    return _servers


@dataclass
class ScriptedResolver:
    """Test host names to chosen addresses; numeric spellings through getaddrinfo(NUMERICHOST).

    Never does a DNS query: a name that is not scripted and not numeric fails like NXDOMAIN.
    """

    names: dict[str, list[str] | Callable[[], list[str]]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append(host)
        answer = self.names.get(host)
        if answer is not None:
            return answer() if callable(answer) else list(answer)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        return [str(info[4][0]) for info in infos]


TEST_NAMES = {
    "media.test": ["127.0.0.1"],
    "evil.test": ["127.0.0.1"],
    "www.cdn.test": ["127.0.0.1"],
    "other.test": ["127.0.0.1"],
    "localhost": ["127.0.0.2"],
    "internal.test": ["127.0.0.2"],
    "metadata.test": ["169.254.169.254"],
    "mixed.test": ["127.0.0.1", "127.0.0.2"],
    "mapped.test": ["::ffff:127.0.0.2"],
    "private.cdn.test": ["10.0.0.1"],
}


@pytest.fixture
def resolver() -> ScriptedResolver:
    return ScriptedResolver(dict(TEST_NAMES))


@pytest.fixture
def connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every (address, port) urllib3 opens a socket to during the test."""
    seen: list[tuple[str, int]] = []
    real = urllib3.util.connection.create_connection

    def spy(address, *args, **kwargs):
        seen.append((address[0], address[1]))
        return real(address, *args, **kwargs)

    monkeypatch.setattr(urllib3.util.connection, "create_connection", spy)
    return seen


@pytest.fixture(scope="session")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("files")
    root = base / "media"
    (root / "sub").mkdir(parents=True)
    (root / "img.png").write_bytes(png_bytes())
    (base / "secret.txt").write_text("outside the media root")
    (root / "escape.png").symlink_to(base / "secret.txt")
    (root / "inside_link.png").symlink_to(root / "img.png")
    return root


@pytest.fixture
def policy(servers: Servers, media_root: Path) -> FetchPolicy:
    """Open policy: any public host, plus exactly the public test server."""
    return FetchPolicy(
        allow_networks=("127.0.0.1/32",),
        allowed_ports=(servers.port,),
        media_root=media_root,
        max_bytes=1024 * 1024,
        max_data_url_bytes=1024,
        connect_timeout=2.0,
        total_timeout=5.0,
        max_redirects=3,
    )


@pytest.fixture
def make_fetcher(policy: FetchPolicy, resolver: ScriptedResolver) -> Callable[..., GuardedFetcher]:
    def make(**changes: object) -> GuardedFetcher:
        return GuardedFetcher(replace(policy, **changes), resolver)

    return make


@pytest.fixture(scope="session")
def make_image() -> Callable[..., bytes]:
    return png_bytes


def png_bytes(size: tuple[int, int] = (64, 48), fmt: str = "PNG", noise: bool = False) -> bytes:
    if noise:
        img = Image.effect_noise(size, 64).convert("RGB")
    else:
        img = Image.new("RGB", size, (200, 30, 90))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()
