"""https: the socket goes to the pinned address, SNI and the certificate check use the host name."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from processors.fetch import GuardedFetcher, MediaRejectedError, MediaTimeoutError

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test ca")
    run("req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=media.test",
        "-addext", "subjectAltName=DNS:media.test")  # fmt: skip
    run("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "leaf.pem", "-days", "2", "-copy_extensions", "copy")  # fmt: skip
    return d


@pytest.fixture(scope="module")
def tls_server(certs: Path, start_server):
    server = start_server(("127.0.0.1", 0))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs / "leaf.pem", certs / "leaf.key")
    server.sni: list[str | None] = []
    ctx.sni_callback = lambda sock, name, _ctx: server.sni.append(name)
    # Handshake lazily in the handler thread, so a failing client does not stall accept().
    server.socket = ctx.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def tls_fetcher(make_fetcher, tls_server, certs):
    tls_server.reset()
    tls_server.sni.clear()
    return make_fetcher(allowed_ports=(tls_server.port,), ca_certs=certs / "ca.pem")


def test_https_pins_the_address_and_checks_the_name(tls_fetcher, tls_server, connects) -> None:
    tls_server.reply("/img.png", body=b"secure")
    got = tls_fetcher.fetch(f"https://media.test:{tls_server.port}/img.png")
    assert got.data == b"secure"
    assert connects == [("127.0.0.1", tls_server.port)]
    assert tls_server.sni == ["media.test"]
    assert tls_server.seen[0].headers["Host"] == f"media.test:{tls_server.port}"


def test_https_certificate_for_another_name_is_rejected(tls_fetcher, tls_server) -> None:
    # other.test resolves to the same server, whose certificate names media.test only.
    with pytest.raises(MediaRejectedError) as info:
        tls_fetcher.fetch(f"https://other.test:{tls_server.port}/img.png")
    assert not info.value.retryable
    assert tls_server.count == 0


def test_https_unknown_ca_is_rejected(make_fetcher, tls_server, resolver) -> None:
    tls_server.reset()
    fetcher = GuardedFetcher(make_fetcher(allowed_ports=(tls_server.port,)).policy, resolver)  # certifi
    with pytest.raises(MediaRejectedError):
        fetcher.fetch(f"https://media.test:{tls_server.port}/img.png")
    assert tls_server.count == 0


def test_stalled_tls_handshake_hits_the_total_deadline(make_fetcher) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept_and_say_nothing, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    fetcher = make_fetcher(allowed_ports=(port,), connect_timeout=5.0, total_timeout=0.5, retries=0)
    started = time.monotonic()
    try:
        with pytest.raises(MediaTimeoutError):
            fetcher.fetch(f"https://media.test:{port}/img.png")
        assert time.monotonic() - started < 1.5
    finally:
        stop.set()
        thread.join()
        listener.close()
        for s in held:
            s.close()
