"""LoRA adapters per key (#58): the native routes ``/v1/adapters`` and what every dialect's routes
share: loading and unloading for the caller, and the adapter a request names.

An adapter belongs to the key that loaded it: another key neither lists nor uses it, and two keys
may each load one of the same name. An admin key's adapters are shared by every key (a key's own
adapter of the same name comes first for it). A key holds at most ``ROLLOUT_MAX_LORAS_PER_KEY``.
Directories are read only under ``ROLLOUT_WEIGHTS_ROOT`` (as weight updates are), and each GPU
worker checks an adapter against the base before it serves it (engine/lora/adapter_files.py);
the call answers once every live GPU worker serves it (domain/adapters/fleet.py).
"""

from __future__ import annotations

from typing import Any

from flask import g
from flask.views import MethodView
from marshmallow import fields, validate, validates_schema

from domain.adapters import fleet
from domain.adapters.store import MODES, SHARED, AdapterEntry, AdapterRegistry
from domain.weights.paths import resolve_weights_dir
from engine.lora.adapter_config import check_adapter_dir
from engine.lora.errors import AdapterNotFoundError
from web.api.schemas import StrictBoolean, refuse_recompute_kv_outside_keep
from web.auth import current_owner
from web.blueprint import Blueprint
from web.schema_base import Schema
from web.services import services

blp = Blueprint("adapters", __name__, description="LoRA adapters per key")

NAME = validate.Regexp(r"^[\w.:@+-]{1,128}$", error="letters, digits and . _ : @ + - (at most 128)")


def registry() -> AdapterRegistry:
    return AdapterRegistry(services().redis)


def _scope() -> str:
    return SHARED if g.get("admin") else current_owner()


def load_for_caller(name: str, path: str, *, inplace: bool = False, mode: str = "finish",
                    recompute_kv: bool = False) -> AdapterEntry:
    """Load (or with ``inplace``, replace by a new version) the caller's adapter ``name``."""
    settings = services().settings
    directory = resolve_weights_dir(path, settings.weights_root)
    # What can be checked without the model, before the registry changes (a bad config is refused
    # with no GPU worker live too); each worker checks the weights against the base.
    check_adapter_dir(directory, root=settings.weights_root, max_rank=settings.max_lora_rank)
    return fleet.load(registry(), scope=_scope(), name=name, path=str(directory), inplace=inplace,
                      per_key_cap=None if g.get("admin") else settings.max_loras_per_key,
                      timeout=settings.weights_update_timeout, mode=mode,
                      recompute_kv=recompute_kv)


def unload_for_caller(name: str) -> AdapterEntry:
    return fleet.unload(registry(), scope=_scope(), name=name, timeout=services().settings.weights_update_timeout)


def visible_adapters() -> list[AdapterEntry]:
    return registry().visible(current_owner())


def resolve(name: str) -> AdapterEntry | None:
    """The adapter ``name`` means for the caller, or None."""
    return registry().resolve(current_owner(), name)


def with_adapter(request: dict[str, Any]) -> dict[str, Any]:
    """``request`` with the engine id of the adapter it names (native ``adapter``, or a dialect's
    ``model`` / ``lora_path`` noted by :func:`choose`) as ``lora_id``; an unknown name is a 404."""
    return named_adapter(request, request.get("adapter") or g.get("lora_adapter"))


def named_adapter(request: dict[str, Any], name: str | None) -> dict[str, Any]:
    """``request`` under the caller's adapter ``name`` (its engine id as ``lora_id``: a batch line
    resolved at upload, run later without the HTTP request); None: as it is."""
    if not name:
        return request
    entry = resolve(name)
    if entry is None:
        raise AdapterNotFoundError(f"adapter {name!r} is not loaded for this key", errors={"adapter": name})
    return {**request, "adapter": name, "lora_id": entry.id}


def choose(name: str | None) -> bool:
    """Note ``name`` as the adapter of this HTTP request's jobs if the caller has one of that name."""
    if name and resolve(name) is not None:
        g.lora_adapter = name
        return True
    return False


class AdapterLoadSchema(Schema):
    name = fields.String(required=True, validate=NAME)
    path = fields.String(required=True, metadata={"description": "A PEFT adapter directory under "
                                                                 "ROLLOUT_WEIGHTS_ROOT"})
    load_inplace = StrictBoolean(load_default=False, metadata={
        "description": "Replace a loaded adapter of that name by a new version (RL updates)"})
    mode = fields.String(load_default="finish", validate=validate.OneOf(MODES), metadata={
        "description": "load_inplace: the old version's rows finish on it, abort now, or keep going under the "
                       "new version from their next token (their weight_versions name both); the base and "
                       "other adapters never pause"})
    recompute_kv = StrictBoolean(load_default=False, metadata={
        "description": "Mode keep: the rows' KV so far is computed again by the new version"})

    @validates_schema
    def _recompute_only_when_kept(self, data, **_kwargs):
        refuse_recompute_kv_outside_keep(data)


class AdapterSchema(Schema):
    name = fields.String()
    version = fields.Integer()
    shared = fields.Boolean(metadata={"description": "Loaded by an admin key: every key may use it"})
    path = fields.String()
    loaded_at = fields.Float()
    id = fields.String()
    mode = fields.String()
    recompute_kv = fields.Boolean()


class AdapterListSchema(Schema):
    data = fields.List(fields.Nested(AdapterSchema))


@blp.route("/v1/adapters")
class Adapters(MethodView):
    @blp.response(200, AdapterListSchema)
    def get(self):
        """The adapters this key may use: its own and the shared ones."""
        return {"data": [entry.view() for entry in visible_adapters()]}

    @blp.arguments(AdapterLoadSchema)
    @blp.response(200, AdapterSchema)
    @blp.alt_response(409, schema=None, description="Loaded already (without load_inplace), a cap reached, "
                                                    "or no ROLLOUT_WEIGHTS_ROOT")
    @blp.alt_response(422, schema=None, description="A bad directory or adapter; nothing changed")
    def post(self, body):
        """Load a PEFT adapter for this key (an admin key's: for every key); answers once every
        live GPU worker serves it."""
        return load_for_caller(body["name"], body["path"], inplace=body["load_inplace"], mode=body["mode"],
                               recompute_kv=body["recompute_kv"]).view()


@blp.route("/v1/adapters/<string:name>")
class Adapter(MethodView):
    @blp.response(200, AdapterSchema)
    @blp.alt_response(404, schema=None, description="No adapter of that name for this key")
    def get(self, name):
        entry = resolve(name)
        if entry is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded for this key", errors={"adapter": name})
        return entry.view()

    @blp.response(200, AdapterSchema)
    @blp.alt_response(404, schema=None, description="No adapter of that name for this key")
    def delete(self, name):
        """Unload it: requests naming it are 404 from now on; rows running under it finish."""
        return unload_for_caller(name).view()
