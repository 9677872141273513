"""GET /healthz: Redis, each worker kind and the model, up or down; Redis' memory against its bound;
the workers that hold messages and make no progress (stalled)."""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import fields

from domain.infra.heartbeats import WORKER_KINDS, alive_workers, live, stalled
from domain.infra.redis_memory import MemoryUse
from web.blueprint import Blueprint
from web.schema_base import Schema
from web.services import services
from workers.gpu.model_check import last_model_check

blp = Blueprint("health", __name__, description="Health")


class RedisMemorySchema(Schema):
    state = fields.String(metadata={
        "description": "ok; refusing_new_work: at the high-water mark (submits answer 503 redis_memory_full while "
                       "accepted work finishes); unbounded: Redis has no maxmemory, nothing is refused"})
    used_bytes = fields.Integer()
    maxmemory_bytes = fields.Integer(metadata={"description": "0: no bound"})
    high_water_bytes = fields.Integer(allow_none=True, metadata={"description": "new work is refused from here"})
    reserved_bytes = fields.Integer(metadata={
        "description": "what accepted jobs' results may still write, counted against the room below the mark"})


class HealthSchema(Schema):
    status = fields.String(metadata={"description": "ok when every part is up, else degraded"})
    redis = fields.String()
    redis_memory = fields.Nested(RedisMemorySchema)
    workers = fields.Dict(keys=fields.String(), values=fields.String())
    model = fields.String()
    stalled_workers = fields.Dict(keys=fields.String(), values=fields.Dict(), metadata={
        "description": "Only when some are: the workers that hold messages and have made no progress (a step, a "
                       "job's end) for ROLLOUT_STALLED_JOB_AFTER seconds, by name: {held, idle_seconds}"})
    model_error = fields.Dict(metadata={
        "description": "Why the model is down, when its last load-time check refused it: code, reason, report"})


@blp.route("/healthz")
class Health(MethodView):
    @blp.response(200, HealthSchema)
    @blp.alt_response(503, schema=HealthSchema, description="Some part is down")
    def get(self):
        """Liveness of every part. Needs no API key."""
        svc = services()
        try:
            beats = live(svc.redis, WORKER_KINDS)
            workers = alive_workers(svc.redis, beats)
            memory = svc.redis_memory.read()
        except Exception:  # any Redis failure means "down" here, not an error
            body = {"status": "degraded", "redis": "down", "workers": dict.fromkeys(WORKER_KINDS, "unknown"),
                    "model": "unknown"}
            return body, 503
        parts = {kind: ("up" if workers.get(kind) else "down") for kind in WORKER_KINDS}
        model = "up" if workers.get("gpu", {}).get("model_ready") else "down"
        stuck = stalled(beats, svc.settings.stalled_job_after)
        ok = (all(state == "up" for state in parts.values()) and model == "up" and not memory.above_high_water
              and not stuck)
        body = {"status": "ok" if ok else "degraded", "redis": "up", "redis_memory": memory_view(memory),
                "workers": parts, "model": model}
        if stuck:
            body["stalled_workers"] = stuck
        check = last_model_check(svc.redis) if model == "down" else None
        if check is not None and not check["passed"]:
            body["model_error"] = {name: check.get(name) for name in ("code", "reason", "report", "at")}
        return body, 200 if ok else 503


def memory_view(memory: MemoryUse) -> dict:
    state = "unbounded" if not memory.bounded else "refusing_new_work" if memory.above_high_water else "ok"
    return {"state": state, "used_bytes": memory.used_bytes, "maxmemory_bytes": memory.maxmemory_bytes,
            "high_water_bytes": memory.high_water_bytes, "reserved_bytes": memory.reserved_bytes}
