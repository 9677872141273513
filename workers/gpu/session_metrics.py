"""A GPU session's metrics: its job ends and generation times (``batch``, which the session's
job ends fill), and the growth of the engine's counters, written at most every
``STATS_REPORT_SECONDS`` (and at the session's end) in one round trip."""

from __future__ import annotations

import time

from domain.infra.metrics import MetricsBatch

STATS_REPORT_SECONDS = 1.0


class SessionMetrics:
    def __init__(self, engine):
        self.engine = engine
        self.batch = MetricsBatch()  # this session's job ends, generation times and engine counters
        self._next_report = time.monotonic() + STATS_REPORT_SECONDS
        self._reported = self._counters()

    def _counters(self) -> dict[str, int]:
        stats = self.engine.stats.snapshot()
        encoder = self.engine.encoder_cache.stats
        return {**{f"engine_{name}": value for name, value in stats.items()},
                "engine_encoder_calls": encoder.calls, "engine_encoder_hits": encoder.hits}

    def report(self, client, *, every: float = STATS_REPORT_SECONDS) -> None:
        now = time.monotonic()
        if now < self._next_report and every:
            return
        self._next_report = now + every
        current = self._counters()
        for name, value in current.items():
            self.batch.count(name, value - self._reported.get(name, 0))
        self._reported = current
        self.batch.flush(client)
