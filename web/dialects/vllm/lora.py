"""vLLM's runtime LoRA routes (``--enable-lora`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``):
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, answered in plain text as vLLM does,
errors in its (OpenAI's) shape. The adapter is then chosen as a request's ``model``
(web/dialects/openai/request.py ``check_model``). Per key: web/api/adapters.py."""

from __future__ import annotations

from flask.views import MethodView
from marshmallow import EXCLUDE, fields

from web.api.adapters import NAME, load_for_caller, unload_for_caller
from web.api.schemas import StrictBoolean
from web.blueprint import Blueprint
from web.dialects.errors import install, openai_shape
from web.schema_base import Schema

blp = Blueprint("vllm_lora", __name__, description="vLLM's runtime LoRA loading")
install(blp, openai_shape)


class VllmLoadLoraSchema(Schema):
    class Meta:
        unknown = EXCLUDE  # vLLM's other fields (base_model_name, ...) are accepted and ignored

    lora_name = fields.String(required=True, validate=NAME)
    lora_path = fields.String(required=True)
    load_inplace = StrictBoolean(load_default=False)


class VllmUnloadLoraSchema(Schema):
    class Meta:
        unknown = EXCLUDE  # lora_int_id: names are what this service goes by

    lora_name = fields.String(required=True, validate=NAME)


def _text(message: str):
    return message, 200, {"Content-Type": "text/plain; charset=utf-8"}


@blp.route("/v1/load_lora_adapter")
class LoadLoraAdapter(MethodView):
    @blp.arguments(VllmLoadLoraSchema)
    def post(self, body):
        """Load a PEFT adapter under ``lora_name`` (``load_inplace``: a new version of a loaded one)."""
        load_for_caller(body["lora_name"], body["lora_path"], inplace=body["load_inplace"])
        return _text(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")


@blp.route("/v1/unload_lora_adapter")
class UnloadLoraAdapter(MethodView):
    @blp.arguments(VllmUnloadLoraSchema)
    def post(self, body):
        unload_for_caller(body["lora_name"])
        return _text(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
