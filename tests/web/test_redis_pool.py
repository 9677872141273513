"""The API's shared Redis pool is as large as its threads (#56, smaller items): every thread of the
process may be in a Redis call at once and none finds the pool empty. redis-py's pools hold 100
by default; 300 of one key's synchronous calls resuming together got 57 pool 503s."""

from __future__ import annotations

import threading


def test_every_thread_of_the_api_may_hold_a_connection_of_the_shared_pool_at_once(make_app):
    app = make_app(api_threads=280, api_stream_slots=20)
    client = app.extensions["rollout"].redis
    start = threading.Barrier(300)
    failures: list[Exception] = []

    def call():
        start.wait()
        try:
            client.blpop(["rq:test:never"], timeout=1)  # holds its connection for a second
        except Exception as e:  # noqa: BLE001 - what the pool raises when it is empty
            failures.append(e)

    threads = [threading.Thread(target=call) for _ in range(300)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert failures == []
