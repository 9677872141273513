"""/v1/jobs/{id}/deliveries and /v1/batches/{id}/deliveries: the webhook events of a job or batch
and every delivery attempt (time, status code, latency, error code). Owners see only their own.
"""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import fields

from web.auth import current_owner
from web.blueprint import Blueprint
from web.schema_base import Schema
from web.services import services

blp = Blueprint("deliveries", __name__, url_prefix="/v1", description="Webhook deliveries")

EVENT_STATES = ("pending", "retrying", "succeeded", "failed", "gone", "blocked")


class AttemptSchema(Schema):
    attempt = fields.Integer(metadata={"description": "1 for the first attempt"})
    at = fields.Float(metadata={"description": "When the attempt started (Unix seconds)"})
    status_code = fields.Integer(allow_none=True, metadata={"description": "The receiver's HTTP status"})
    latency_ms = fields.Float()
    error = fields.String(allow_none=True, metadata={"description": "Error code; null on success"})
    outcome = fields.String(metadata={"description": "The event's state after this attempt"})


class DeliverySchema(Schema):
    id = fields.String(metadata={"description": "The event id, sent as the webhook-id header"})
    object = fields.Constant("webhook_event")
    type = fields.String()
    url = fields.String()
    status = fields.String(metadata={"description": " | ".join(EVENT_STATES)})
    created_at = fields.Float()
    completed_at = fields.Float(allow_none=True)
    next_attempt_at = fields.Float(allow_none=True)
    attempts = fields.List(fields.Nested(AttemptSchema))


class DeliveryListSchema(Schema):
    data = fields.List(fields.Nested(DeliverySchema))


@blp.route("/jobs/<string:job_id>/deliveries")
class JobDeliveries(MethodView):
    @blp.response(200, DeliveryListSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such job for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, job_id):
        """The job's webhook events and their delivery attempts."""
        svc = services()
        svc.jobs.get(job_id, owner=current_owner())
        return {"data": svc.webhooks.deliveries("job", job_id)}


@blp.route("/batches/<string:batch_id>/deliveries")
class BatchDeliveries(MethodView):
    @blp.response(200, DeliveryListSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such batch for this key")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def get(self, batch_id):
        """The batch's webhook events and their delivery attempts."""
        svc = services()
        svc.batches.get(batch_id, owner=current_owner())
        return {"data": svc.webhooks.deliveries("batch", batch_id)}
