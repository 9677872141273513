"""GET /metrics in Prometheus format: jobs by status, queue depths, stage latency histograms.

Served only to the scrape addresses (``ROLLOUT_METRICS_ALLOW_NETWORKS``, loopback by default):
its counters move with each job, so read by anyone they would tell one key what another sent (a
multimodal cache hit on bytes another key sent first).
"""

from __future__ import annotations

import ipaddress

from flask import Blueprint, Response, request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from domain.infra.metrics import snapshot
from domain.names import BATCHES_QUEUE, PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, WEBHOOKS_QUEUE
from engine.errors import ForbiddenError
from web.services import services

blp = Blueprint("metrics", __name__)


class RedisCollector:
    """Reads the numbers every process keeps in Redis (see ``domain.infra.metrics``) at scrape time."""

    def __init__(self, svc):
        self.svc = svc

    def collect(self):
        queues = [PREPROCESS_QUEUE, self.svc.settings.generate_queue, SHARED_GENERATE_QUEUE, WEBHOOKS_QUEUE,
                  BATCHES_QUEUE]
        numbers = snapshot(self.svc.redis, queues)
        depth = GaugeMetricFamily("rollout_queue_depth", "Messages waiting in each Celery queue", labels=["queue"])
        for queue, length in numbers.queue_depths.items():
            depth.add_metric([queue], length)
        yield depth

        active = GaugeMetricFamily("rollout_jobs_active", "Jobs not yet finished")
        active.add_metric([], self.svc.jobs.active_counts())
        yield active

        ended = CounterMetricFamily("rollout_jobs_ended", "Jobs that ended, by status", labels=["status"])
        for status, value in numbers.jobs_ended.items():
            ended.add_metric([status], value)
        yield ended

        counters = CounterMetricFamily("rollout_events", "Cache hits and misses, transport kinds", labels=["event"])
        for name, value in numbers.counters.items():
            counters.add_metric([name], value)
        yield counters

        memory = self.svc.redis_memory.read()
        used = GaugeMetricFamily("rollout_redis_used_memory_bytes", "Redis' used_memory (INFO memory)")
        used.add_metric([], memory.used_bytes)
        yield used
        bound = GaugeMetricFamily("rollout_redis_maxmemory_bytes",
                                  "Redis' maxmemory, 0 when unbounded; new work is refused from 90 % of it")
        bound.add_metric([], memory.maxmemory_bytes)
        yield bound

        latency = HistogramMetricFamily("rollout_stage_seconds", "Time spent in each stage", labels=["stage"])
        for stage, histogram in numbers.stages.items():
            latency.add_metric([stage], histogram.buckets, histogram.total_seconds)
        yield latency


@blp.route("/metrics")
def metrics() -> Response:
    svc = services()
    if not may_scrape(request.remote_addr, svc.settings.metrics_allow_networks):
        raise ForbiddenError("/metrics is served to the scrape addresses only (ROLLOUT_METRICS_ALLOW_NETWORKS)")
    registry = CollectorRegistry()
    registry.register(RedisCollector(svc))
    return Response(generate_latest(registry), mimetype="text/plain; version=0.0.4")


def may_scrape(address: str | None, networks: tuple[str, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:  # a unix socket, or no peer address at all
        return False
    return any(ip in ipaddress.ip_network(net, strict=False) for net in networks)
