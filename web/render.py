"""POST /v1/render: chat messages → the exact token ids and content parts a job should carry."""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import Schema, fields, validate

from web.auth import current_owner
from web.blueprint import Blueprint
from web.schemas import ContentPartSchema
from web.services import services

blp = Blueprint("render", __name__, description="Chat template rendering (CPU only, synchronous)")


class RenderRequestSchema(Schema):
    messages = fields.List(
        fields.Dict(), required=True, validate=validate.Length(min=1, max=1024),
        metadata={"description": "OpenAI-style chat messages; media parts as {type: image_url | video_url | "
                             "audio_url, <type>: {url}} or {type: input_audio, input_audio: {data, format}}"},
    )


class RenderResponseSchema(Schema):
    token_ids = fields.List(fields.Integer(), metadata={"description": "Media placeholders already expanded"})
    content_parts = fields.List(fields.Nested(ContentPartSchema))


@blp.route("/v1/render")
class Render(MethodView):
    @blp.arguments(RenderRequestSchema)
    @blp.response(200, RenderResponseSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(413, schema=None, description="Body too large")
    @blp.alt_response(422, schema=None, description="Invalid messages, or media that cannot be fetched")
    @blp.alt_response(503, schema=None, description="Job store unavailable")
    def post(self, body):
        """Render messages through the model's chat template; send the result to /v1/jobs as is."""
        from processors.render import render

        svc = services()
        return render(body["messages"], svc.processor, fetcher=svc.fetcher, cache=svc.mm_cache,
                      limits=svc.processing_limits, owner=current_owner())
