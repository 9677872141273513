"""The Responses API's routes (``POST /v1/responses``, ``GET /v1/responses/{id}``) on the OpenAI
blueprint (web/dialects/openai/views.py): a plain reply from the chat route's job and reply, or
its events (web/dialects/openai/responses_stream.py)."""

from __future__ import annotations

from flask.views import MethodView

from web.auth import current_owner
from web.dialects.common import run_jobs
from web.dialects.openai import responses as api
from web.dialects.openai.responses_stream import ResponseEvents
from web.dialects.openai.session_turns import HEADER as SESSION_HEADER
from web.dialects.streaming import dialect_stream


def responses_routes(blp, documented) -> None:
    @blp.route("/v1/responses")
    class Responses(MethodView):
        @blp.arguments(api.ResponsesRequestSchema)
        @blp.response(200)
        @documented
        def post(self, body):
            """OpenAI's Responses API on the chat route's path: input items, function tools,
            reasoning, text.format; stored responses continue by previous_response_id."""
            chat, request, turn, _ = api.prepare(body)
            if body.get("stream"):
                response = dialect_stream([request], ResponseEvents(body, chat, request, turn))
                if turn is not None:
                    response.headers[SESSION_HEADER] = turn.header()
                return response
            (job,) = run_jobs([request])
            reply = api.ended(body, chat, request, turn, job)
            return reply, 200, ({SESSION_HEADER: turn.header()} if turn is not None else {})

    @blp.route("/v1/responses/<response_id>")
    class StoredResponse(MethodView):
        @blp.response(200)
        @documented
        def get(self, response_id):
            """A stored response of this key (store: true), for ROLLOUT_RESULT_TTL."""
            stored = api.response_store().get(current_owner(), response_id)
            if stored is None:
                raise api.ResponseNotFoundError(f"No response with id '{response_id}' found.",
                                                errors={"response_id": ["no stored response of this key"]})
            return stored.response
