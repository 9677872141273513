"""One media deadline per request, parts fetched at once, DNS inside the deadline.

Real slow servers on loopback: each part's server waits before it answers. Before these rules a
request's parts were fetched one after another, each under a deadline of its own, so four parts
just under the deadline held a worker four deadlines long.
"""

from __future__ import annotations

import time

import pytest

from engine.limits import Limits, MediaLimits
from processors.fetch import MediaRejectedError, MediaTimeoutError
from processors.pipeline import preprocess

QWEN = "<|vision_start|><|image_pad|><|vision_end|>"


def slow_image(servers, path: str, delay: float, image: bytes) -> str:
    def handler(req):
        time.sleep(delay)
        servers.public.respond(req, 200, image, {"Content-Type": "image/png"})

    servers.public.route(path, handler)
    return f"http://media.test:{servers.port}{path}"


def run(processors, transport, fetcher, urls, *, concurrency: int):
    request = {"prompt": QWEN * len(urls), "content_parts": [{"type": "image_url", "url": u} for u in urls]}
    return preprocess(request, processor=processors["qwen2_vl"], fetcher=fetcher, cache=None, transport=transport,
                      limits=Limits(media=MediaLimits(fetch_concurrency=concurrency)))


def test_parts_are_fetched_at_once(processors, transport, make_fetcher, servers, make_image):
    urls = [slow_image(servers, f"/together-{i}.png", 1.0, make_image()) for i in range(4)]
    started = time.monotonic()
    processed = run(processors, transport, make_fetcher(total_timeout=3.0), urls, concurrency=4)
    elapsed = time.monotonic() - started
    assert len(processed.placeholder_ranges) == 4
    assert elapsed < 2.5, f"4 parts of 1 s each took {elapsed:.1f} s: not fetched at once"


def test_one_deadline_covers_every_part(processors, transport, make_fetcher, servers, make_image):
    # One at a time, each part well inside the deadline, all of them together past it.
    urls = [slow_image(servers, f"/budget-{i}.png", 0.9, make_image()) for i in range(4)]
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError) as caught:
        run(processors, transport, make_fetcher(total_timeout=2.0, retries=0), urls, concurrency=1)
    elapsed = time.monotonic() - started
    assert elapsed < 3.2, f"the request's media took {elapsed:.1f} s against a 2 s deadline"
    assert caught.value.errors["part"] == 2  # parts 0 and 1 fit (1.8 s), part 2 ran out


def test_the_first_failing_part_stops_the_others(processors, transport, make_fetcher, servers, make_image):
    slow = slow_image(servers, "/stop-slow.png", 6.0, make_image())
    servers.public.reply("/stop-missing.png", 404)
    missing = f"http://media.test:{servers.port}/stop-missing.png"
    started = time.monotonic()
    with pytest.raises(MediaRejectedError) as caught:
        run(processors, transport, make_fetcher(total_timeout=8.0), [slow, missing], concurrency=4)
    assert caught.value.errors["part"] == 1
    assert time.monotonic() - started < 3.0, "the slow part was waited for after the other one failed"


def test_dns_resolution_counts_inside_the_deadline(make_fetcher, resolver, servers, make_image):
    servers.public.reply("/dns.png", 200, make_image(), {"Content-Type": "image/png"})
    resolver.names["slow-dns.test"] = lambda: (time.sleep(4.0), ["127.0.0.1"])[1]
    fetcher = make_fetcher(total_timeout=0.8)
    started = time.monotonic()
    with pytest.raises(MediaTimeoutError):
        fetcher.fetch(f"http://slow-dns.test:{servers.port}/dns.png")
    assert time.monotonic() - started < 2.0, "a slow name server held the fetch past its deadline"
