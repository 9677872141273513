"""``GET /v1/sessions/{id}/trajectory``: an agent session's turns as a trainer reads them (#57
item 4): per segment one token sequence, its loss mask (1 sampled, 0 given), and per token the
sampled one's logprob and weight version (domain/sessions/trajectory.py). Owners see only their
own sessions; another key's, or one expired, is a 404."""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import ValidationError

from domain.sessions.store import SessionStore
from engine.errors import NotFoundError
from web.api.session_header import validate_session_id
from web.auth import current_owner
from web.blueprint import Blueprint
from web.services import services

blp = Blueprint("sessions", __name__, url_prefix="/v1", description="Agent sessions' token trajectories")


class SessionNotFoundError(NotFoundError):
    code = "session_not_found"


@blp.route("/sessions/<path:session_id>/trajectory")
class SessionTrajectory(MethodView):
    @blp.response(200)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(404, schema=None, description="No such session for this key")
    @blp.alt_response(503, schema=None, description="Store unavailable")
    def get(self, session_id: str):
        """The session's kept segments, oldest first: token_ids, loss_mask, logprobs, weight_versions, turns."""
        svc = services()
        found = None
        try:
            validate_session_id(session_id)
        except ValidationError:  # no session can have this id: answered as any unknown one
            pass
        else:
            found = SessionStore(svc.redis, ttl=svc.settings.result_ttl).trajectory(current_owner(), session_id)
        if found is None:
            raise SessionNotFoundError(f"no session {session_id!r} for this key")
        return {"object": "session.trajectory", "id": session_id, **found}
