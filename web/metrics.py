"""GET /metrics in Prometheus format: jobs by status, queue depths, stage latency histograms."""

from __future__ import annotations

from flask import Blueprint, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from web.services import services
from workers.metrics import STAGE_BUCKETS, STAGES
from workers.names import BATCHES_QUEUE, PREPROCESS_QUEUE, SHARED_GENERATE_QUEUE, WEBHOOKS_QUEUE

blp = Blueprint("metrics", __name__)


class RedisCollector:
    """Reads the numbers every process keeps in Redis (see ``workers.metrics``) at scrape time."""

    def __init__(self, svc):
        self.svc = svc

    def collect(self):
        r = self.svc.redis
        queues = [PREPROCESS_QUEUE, self.svc.settings.generate_queue, SHARED_GENERATE_QUEUE, WEBHOOKS_QUEUE,
                  BATCHES_QUEUE]
        depth = GaugeMetricFamily("rollout_queue_depth", "Messages waiting in each Celery queue", labels=["queue"])
        pipe = r.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        for queue, length in zip(queues, pipe.execute(), strict=True):
            depth.add_metric([queue], length)
        yield depth

        active = GaugeMetricFamily("rollout_jobs_active", "Jobs not yet finished")
        active.add_metric([], self.svc.jobs.active_counts())
        yield active

        ended = CounterMetricFamily("rollout_jobs_ended", "Jobs that ended, by status", labels=["status"])
        for status, value in sorted(r.hgetall("rq:metrics:jobs_ended").items()):
            ended.add_metric([status.decode()], int(value))
        yield ended

        counters = CounterMetricFamily("rollout_events", "Cache hits and misses, transport kinds", labels=["event"])
        for name, value in sorted(r.hgetall("rq:metrics:counters").items()):
            counters.add_metric([name.decode()], int(value))
        yield counters

        latency = HistogramMetricFamily("rollout_stage_seconds", "Time spent in each stage", labels=["stage"])
        for stage in STAGES:
            raw = {k.decode(): float(v) for k, v in r.hgetall(f"rq:metrics:stage:{stage}").items()}
            cumulative, buckets = 0.0, []
            for bound in STAGE_BUCKETS:
                cumulative += raw.get(repr(bound), 0)
                buckets.append((repr(bound), cumulative))
            buckets.append(("+Inf", cumulative + raw.get("+Inf", 0)))
            latency.add_metric([stage], buckets, raw.get("sum", 0.0))
        yield latency


@blp.route("/metrics")
def metrics() -> Response:
    registry = CollectorRegistry()
    registry.register(RedisCollector(services()))
    return Response(generate_latest(registry), mimetype="text/plain; version=0.0.4")
