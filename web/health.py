"""GET /healthz: Redis, each worker kind and the model, up or down."""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import fields

from web.blueprint import Blueprint
from web.schema_base import Schema
from web.services import services
from workers.gpu.model_check import last_model_check
from workers.infra.heartbeats import WORKER_KINDS, alive_workers

blp = Blueprint("health", __name__, description="Health")


class HealthSchema(Schema):
    status = fields.String(metadata={"description": "ok when every part is up, else degraded"})
    redis = fields.String()
    workers = fields.Dict(keys=fields.String(), values=fields.String())
    model = fields.String()
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
            workers = alive_workers(svc.redis)
        except Exception:  # any Redis failure means "down" here, not an error
            body = {"status": "degraded", "redis": "down", "workers": dict.fromkeys(WORKER_KINDS, "unknown"),
                    "model": "unknown"}
            return body, 503
        parts = {kind: ("up" if workers.get(kind) else "down") for kind in WORKER_KINDS}
        model = "up" if workers.get("gpu", {}).get("model_ready") else "down"
        ok = all(state == "up" for state in parts.values()) and model == "up"
        body = {"status": "ok" if ok else "degraded", "redis": "up", "workers": parts, "model": model}
        check = last_model_check(svc.redis) if model == "down" else None
        if check is not None and not check["passed"]:
            body["model_error"] = {name: check.get(name) for name in ("code", "reason", "report", "at")}
        return body, 200 if ok else 503
