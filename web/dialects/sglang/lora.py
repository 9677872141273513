"""SGLang's LoRA routes: ``/load_lora_adapter`` and ``/unload_lora_adapter``, answered as SGLang's
``LoadLoRAAdapterReqOutput`` (``success``, ``error_message``, ``loaded_adapters``), errors in its
shape. The adapter is then chosen per request by ``lora_path`` on ``/generate``. Per key:
web/api/adapters.py."""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import EXCLUDE, fields

from web.api.adapters import NAME, load_for_caller, unload_for_caller, visible_adapters
from web.blueprint import Blueprint
from web.dialects.errors import install, sglang_shape
from web.schema_base import Schema

blp = Blueprint("sglang_lora", __name__, description="SGLang's LoRA loading")
install(blp, sglang_shape)


class SglangLoadLoraSchema(Schema):
    class Meta:
        unknown = EXCLUDE  # pinned, lora_id: accepted and ignored

    lora_name = fields.String(required=True, validate=NAME)
    lora_path = fields.String(required=True)


class SglangUnloadLoraSchema(Schema):
    class Meta:
        unknown = EXCLUDE

    lora_name = fields.String(required=True, validate=NAME)


def _reply() -> dict:
    return {"success": True, "error_message": "",
            "loaded_adapters": {entry.name: entry.path for entry in visible_adapters()}}


@blp.route("/load_lora_adapter")
class LoadLoraAdapter(MethodView):
    @blp.arguments(SglangLoadLoraSchema)
    def post(self, body):
        load_for_caller(body["lora_name"], body["lora_path"])
        return _reply()


@blp.route("/unload_lora_adapter")
class UnloadLoraAdapter(MethodView):
    @blp.arguments(SglangUnloadLoraSchema)
    def post(self, body):
        unload_for_caller(body["lora_name"])
        return _reply()
