"""POST /v1/render: chat messages → the exact token ids and content parts a job should carry.

``render_on_worker`` is the one way the API renders (also for vLLM's render routes): a CPU worker
renders, fetching the media under a job's limits and media deadline, and the request waits for it,
bounded; the API's threads never fetch.
"""

from __future__ import annotations

from typing import Any

from flask.views import MethodView
from marshmallow import fields, validate

from domain.infra.fair_share import KeyShare
from domain.infra.heartbeats import any_alive
from domain.infra.redis_records import new_id
from domain.renders import NoRenderWorkerError, request_render, wait_bound, wait_render
from engine.errors import RateLimitedError
from engine.request_rules import check_media_count
from processors.chat_messages import template_messages
from web.api.schemas import ContentPartSchema
from web.auth import current_owner
from web.blueprint import Blueprint
from web.schema_base import Schema
from web.services import services

blp = Blueprint("render", __name__, description="Chat template rendering (on a CPU worker; the request waits for it)")


class RenderRequestSchema(Schema):
    messages = fields.List(
        fields.Dict(), required=True, validate=validate.Length(min=1, max=1024),
        metadata={"description": "OpenAI-style chat messages; media parts as {type: image_url, image_url: {url}} "
                                 "(also video_url, audio_url, input_audio)"},
    )


class RenderResponseSchema(Schema):
    token_ids = fields.List(fields.Integer(), metadata={"description": "Media placeholders already expanded"})
    content_parts = fields.List(fields.Nested(ContentPartSchema))


class TooManyRendersError(RateLimitedError):
    code = "too_many_renders"


def render_on_worker(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"token_ids", "content_parts"}`` of ``messages``, rendered by a CPU worker for the caller's key."""
    svc = services()
    settings = svc.settings
    _, parts = template_messages(messages)  # malformed messages: 422 before queueing
    check_media_count(len(parts), svc.limits.media.max_items, "media parts")
    if not any_alive(svc.redis, "cpu"):
        raise NoRenderWorkerError("no CPU worker is running to render; retry shortly", headers={"Retry-After": "5"})
    owner = current_owner()
    wait_s = wait_bound(settings.fetch_timeout)
    # Each waiting render holds a request thread: a key may hold only a few of them.
    share = KeyShare(svc.redis, "api-render", per_key=settings.render_per_key, lease_s=wait_s + 30)
    member = new_id("slot")
    if not share.acquire(owner, member):
        raise TooManyRendersError(
            f"at most {settings.render_per_key} renders of one key run at once",
            headers={"Retry-After": "1"},
        )
    try:
        render_id = request_render(svc.redis, svc.celery, owner=owner, messages=messages, wait_s=wait_s)
        return wait_render(svc.redis, render_id, wait_s)
    finally:
        share.release(owner, member)


@blp.route("/v1/render")
class Render(MethodView):
    @blp.arguments(RenderRequestSchema)
    @blp.response(200, RenderResponseSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="Body too large")
    @blp.alt_response(422, schema=None, description="Invalid messages, or media that cannot be fetched")
    @blp.alt_response(429, schema=None, description="Too many renders of this key at once")
    @blp.alt_response(503, schema=None, description="Job store unavailable, or no worker rendered in time")
    def post(self, body):
        """Render messages through the model's chat template; send the result to /v1/jobs as is.

        A CPU worker renders (fetching the images under a job's limits and media deadline); this
        request waits for it, bounded."""
        return render_on_worker(body["messages"])
