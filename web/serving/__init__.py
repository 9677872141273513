"""Serving HTTP: the gunicorn server and its hooks (``server``), a request collected whole by the
event loop before a thread sees it, in gunicorn's own grammar, and handed on re-framed
(``request_framing``, ``chunked_body``, ``request_buffering``, ``early_errors``),
body limits, JSON bodies, a client that hung up (``client_gone``), the per-key share of API
threads (``thread_share``) and long-poll slots (``wait_slots``), and the allocator setting."""
