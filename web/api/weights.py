"""Weight updates and pausing (admin keys only): ``/v1/weights`` and SGLang's refit routes.

``POST /v1/weights`` checks the directory here first (under ``ROLLOUT_WEIGHTS_ROOT``, same
architecture, tensor names and shapes from the safetensors headers), so a bad directory is a 422
that changes nothing; then it sets the fleet's target and answers once every live GPU worker
serves it (see ``domain/weights/updates.py``). SGLang's ``/update_weights_from_disk``,
``/pause_generation`` and ``/continue_generation`` map onto the same calls for RL frameworks that
speak SGLang (slime, AReaL); their replies are SGLang's ``{success, message, num_paused_requests}``.
"""

from __future__ import annotations

from dataclasses import asdict

from flask.views import MethodView
from marshmallow import EXCLUDE, fields, validate, validates_schema

from domain.weights.paths import resolve_weights_dir
from domain.weights.store import MODES, PAUSE_MODES
from domain.weights.updates import fleet_paused, update_weights
from engine.checkpoint_dir import CheckpointDir
from engine.checkpoints import check_checkpoint, weight_version_of
from web.api.schemas import StrictBoolean, refuse_recompute_kv_outside_keep
from web.auth import require_admin
from web.blueprint import Blueprint
from web.schema_base import Schema
from web.services import services

blp = Blueprint("weights", __name__, description="Weight updates (admin keys only)")

PAUSE_REPORT_SECONDS = 5.0
_VERSION = validate.Regexp(r"^[\w.:@+-]{1,128}$", error="letters, digits and . _ : @ + - (at most 128)")


class WeightsUpdateSchema(Schema):
    model_path = fields.String(required=True, metadata={"description": "A model directory under ROLLOUT_WEIGHTS_ROOT"})
    weight_version = fields.String(required=True, validate=_VERSION)
    mode = fields.String(load_default="finish", validate=validate.OneOf(MODES),
                         metadata={"description": "What rows in flight do: finish on the old weights, abort now, "
                                                  "retract (run again from the prompt on the new weights), or keep "
                                                  "(go on under the new weights from where they were)"})
    recompute_kv = StrictBoolean(load_default=False, metadata={
        "description": "mode keep: the new weights compute the kept rows' KV again (else they attend to the old)"})
    timeout_s = fields.Float(validate=validate.Range(min=0, max=3600))

    @validates_schema
    def _recompute_only_when_kept(self, data, **_kwargs):
        refuse_recompute_kv_outside_keep(data)


class SglangUpdateSchema(Schema):
    class Meta:
        unknown = EXCLUDE  # SGLang's other fields (load_format, is_async, ...) are accepted and ignored

    model_path = fields.String(required=True)
    weight_version = fields.String(load_default=None, allow_none=True, validate=_VERSION)
    abort_all_requests = fields.Boolean(load_default=False)
    flush_cache = fields.Boolean(load_default=True, metadata={
        "description": "Caches keyed by the weights are always cleared on a switch"})


class SglangPauseSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    mode = fields.String(load_default="abort", validate=validate.OneOf(PAUSE_MODES))


class WorkerWeightsSchema(Schema):
    worker = fields.String()
    node = fields.String()
    state = fields.String(metadata={"description": "starting | loading | serving | failed"})
    version = fields.String(allow_none=True, metadata={"description": "The weight version it serves"})
    target_id = fields.String(allow_none=True)
    paused = fields.Boolean()
    error = fields.Dict(allow_none=True)
    interrupted = fields.Integer()
    at = fields.Float()


class TargetSchema(Schema):
    id = fields.String()
    version = fields.String()
    model_path = fields.String()
    mode = fields.String()
    set_at = fields.Float()
    recompute_kv = fields.Boolean()
    digest = fields.String(metadata={"description": "content digest of the weights, bound by the first worker "
                                                    "to load them; empty until then"})


class WeightsStateSchema(Schema):
    target = fields.Nested(TargetSchema, allow_none=True)
    paused = fields.String(allow_none=True)
    workers = fields.List(fields.Nested(WorkerWeightsSchema))


class WeightsReportSchema(Schema):
    success = fields.Boolean()
    message = fields.String()
    num_paused_requests = fields.Integer()
    weight_version = fields.String()
    target = fields.Nested(TargetSchema)
    workers = fields.List(fields.Nested(WorkerWeightsSchema))


class SglangReplySchema(Schema):
    success = fields.Boolean()
    message = fields.String()
    num_paused_requests = fields.Integer()


def _update(model_path: str, version: str | None, mode: str, timeout: float | None, *,
            recompute_kv: bool = False) -> dict:
    require_admin()
    svc = services()
    directory = resolve_weights_dir(model_path, svc.settings.weights_root)
    with CheckpointDir.open(directory, root=svc.settings.weights_root) as checkpoint:
        check_checkpoint(checkpoint, svc.model_path)
        version = version or weight_version_of(checkpoint)
    timeout = svc.settings.weights_update_timeout if timeout is None else timeout
    report = update_weights(svc.weight_store, version=version, model_path=str(directory), mode=mode,
                            timeout=timeout, recompute_kv=recompute_kv)
    return report.to_dict()


ERRORS = ((401, "Missing or invalid API key"), (403, "Not an admin key"),
          (409, "Weight updates are not enabled (no ROLLOUT_WEIGHTS_ROOT)"),
          (422, "Bad directory or request; nothing changed"),
          (504, "Not every live GPU worker serves the weights in time; per-worker report in errors"))


def _document_errors(view):
    for status, description in ERRORS:
        view = blp.alt_response(status, schema=None, description=description)(view)
    return view


@blp.route("/v1/weights")
class Weights(MethodView):
    @blp.response(200, WeightsStateSchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(403, schema=None, description="Not an admin key")
    def get(self):
        """The fleet's target weights and what each live GPU worker serves."""
        require_admin()
        store = services().weight_store
        target, pause = store.read()
        return {"target": asdict(target) if target else None, "paused": pause.mode if pause else None,
                "workers": [asdict(w) for w in store.workers()]}

    @blp.arguments(WeightsUpdateSchema)
    @blp.response(200, WeightsReportSchema)
    @_document_errors
    def post(self, body):
        """Update every GPU worker to the weights at ``model_path``; answers when all live ones serve them."""
        return _update(body["model_path"], body["weight_version"], body["mode"], body.get("timeout_s"),
                       recompute_kv=body["recompute_kv"])


@blp.route("/update_weights_from_disk")
class UpdateWeightsFromDisk(MethodView):
    @blp.arguments(SglangUpdateSchema)
    @blp.response(200, SglangReplySchema)
    @_document_errors
    def post(self, body):
        """SGLang's refit call: ``abort_all_requests`` aborts rows in flight, else they finish."""
        report = _update(body["model_path"], body["weight_version"],
                         "abort" if body["abort_all_requests"] else "finish", None)
        return {"success": True, "message": report["message"], "num_paused_requests": report["num_paused_requests"]}


@blp.route("/pause_generation")
class PauseGeneration(MethodView):
    @blp.arguments(SglangPauseSchema)
    @blp.response(200, SglangReplySchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(403, schema=None, description="Not an admin key")
    def post(self, body):
        """Workers take no new work until /continue_generation; rows in flight abort, are retracted
        (requeued), finish (``finish``) or hold still (``in_place``): an update meanwhile swaps the
        weights under them and they go on under the new ones after continue (update mode keep)."""
        require_admin()
        store = services().weight_store
        workers = fleet_paused(store, store.pause(body["mode"]), PAUSE_REPORT_SECONDS)
        return {"success": True, "message": f"generation paused ({body['mode']}) on {len(workers)} GPU workers",
                "num_paused_requests": sum(w.interrupted for w in workers)}


@blp.route("/continue_generation")
class ContinueGeneration(MethodView):
    @blp.response(200, SglangReplySchema)
    @blp.alt_response(401, schema=None, description="Missing or invalid API key")
    @blp.alt_response(403, schema=None, description="Not an admin key")
    def post(self):
        """Workers take work again."""
        require_admin()
        services().weight_store.resume()
        return {"success": True, "message": "generation continues", "num_paused_requests": 0}
