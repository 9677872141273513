"""Whether the client of the request being served has hung up.

A synchronous dialect call waits on its jobs for up to ``ROLLOUT_SYNC_TIMEOUT_MAX``; a client that
gave up (a trainer's own timeout, a killed rollout) would leave its jobs generating for nobody.
vLLM and SGLang abort a request whose client disconnects; so do we, by looking at the connection
between waits. WSGI has no disconnect signal, so this reads the socket the server puts in the
environ (gunicorn's and werkzeug's): a peek that reads end-of-file means the peer closed it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from flask import request

_SOCKET_KEYS = ("gunicorn.socket", "werkzeug.socket")


def hung_up_check() -> Callable[[], bool]:
    """A check for this request's client: True once it has closed the connection. Where the
    server gives no socket (a test client), it never says so."""
    sock = next((request.environ[key] for key in _SOCKET_KEYS if key in request.environ), None)
    if sock is None:
        return lambda: False

    def hung_up() -> bool:
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # open, nothing sent: waiting for our answer
        except ValueError:
            return False  # a TLS socket takes no flags: we cannot tell
        except OSError:
            return True  # reset by the peer
    return hung_up
