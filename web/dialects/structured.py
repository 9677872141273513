"""Each dialect's structured-output fields onto our one ``sampling_params.structured_output``
(engine/grammar/spec.py: one of json_schema, json_object, regex, choice, grammar).

- OpenAI's ``response_format``: ``{type: text}``, ``{type: json_object}``,
  ``{type: json_schema, json_schema: {name, schema, strict, description}}``;
- vLLM's ``structured_outputs`` (``StructuredOutputsParams``: ``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``), its older ``guided_decoding`` object of the same keys, and the
  older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- SGLang's sampling params ``json_schema`` (JSON text; ``"$$ANY$$"`` for any JSON), ``regex``, ``ebnf``.

One constraint per request: two are a 422 ``invalid_grammar`` naming them. What is not served
(vLLM's ``structural_tag`` and ``whitespace_pattern``, SGLang's ``structural_tag``) is a 422 too.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from engine.grammar.errors import InvalidGrammarError

# vLLM's StructuredOutputsParams keys -> ours.
_VLLM_KINDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
# Its options, each accepted at the values whose meaning holds here: JSON is always compact
# (no free whitespace) and an object never gains properties its schema does not list.
_VLLM_OPTIONS = {"disable_any_whitespace": (True, False), "disable_additional_properties": (True, False),
                 "disable_fallback": (True, False), "whitespace_pattern": (None,), "structural_tag": (None,)}
VLLM_TOP_LEVEL = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
SGLANG_ANY_JSON = "$$ANY$$"


def vllm_structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """Our ``structured_output`` from vLLM's fields in ``body`` (a SamplingParams or an OpenAI
    body with vLLM's extras), or None."""
    found: dict[str, dict[str, Any]] = {}
    for field in ("structured_outputs", "guided_decoding"):
        if body.get(field) is not None:
            found[field] = _vllm_object(body[field], field)
    for field, kind in VLLM_TOP_LEVEL.items():
        if body.get(field) is not None:
            found[field] = {kind: _json_value(body[field], field) if kind == "json_schema" else body[field]}
    return _one(found)


def openai_structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """Our ``structured_output`` from an OpenAI body: its ``response_format`` or vLLM's fields."""
    found = {}
    if (response_format := body.get("response_format")) is not None:
        if (native := _response_format(response_format)) is not None:
            found["response_format"] = native
    if (vllm := vllm_structured(body)) is not None:
        found["structured_outputs"] = vllm
    return _one(found)


def sglang_structured(sampling: dict[str, Any]) -> dict[str, Any] | None:
    """Our ``structured_output`` from SGLang's sampling params, or None."""
    found = {}
    if sampling.get("json_schema") is not None:
        given = sampling["json_schema"]
        found["json_schema"] = ({"json_object": True} if given == SGLANG_ANY_JSON
                                else {"json_schema": _json_value(given, "json_schema")})
    if sampling.get("regex") is not None:
        found["regex"] = {"regex": sampling["regex"]}
    if sampling.get("ebnf") is not None:
        found["ebnf"] = {"grammar": sampling["ebnf"]}
    return _one(found)


def _response_format(value: Any) -> dict[str, Any] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _invalid("response_format.json_schema", "must be an object with a name and a schema")
        schema = spec.get("schema")
        return {"json_object": True} if schema is None else {"json_schema": _json_value(schema, "response_format")}
    raise _invalid("response_format.type", "one of text, json_object, json_schema")


def _vllm_object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(field, "must be an object")
    unknown = set(value) - set(_VLLM_KINDS) - set(_VLLM_OPTIONS)
    if unknown:
        raise _invalid(field, f"unknown keys: {', '.join(sorted(unknown))}")
    for option, allowed in _VLLM_OPTIONS.items():
        if option in value and value[option] not in allowed:
            raise _invalid(f"{field}.{option}", f"not supported here; leave it out or send {allowed[0]!r}")
    kinds = {key: item for key, item in value.items() if key in _VLLM_KINDS and item not in (None, False)}
    if len(kinds) != 1:
        raise _invalid(field, f"give exactly one of {', '.join(_VLLM_KINDS)}")
    [(key, item)] = kinds.items()
    return {_VLLM_KINDS[key]: _json_value(item, f"{field}.json") if key == "json" else item}


def _json_value(value: Any, field: str) -> Any:
    """A schema given as an object, or as its JSON text (vLLM and SGLang take both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _invalid(field, "not valid JSON") from None
    return checked_schema(value, field)


def checked_schema(value: Any, field: str) -> Any:
    """``value`` when it is a JSON Schema by its own draft's metaschema (2020-12 when it names none):
    a schema no worker could compile is a 422 here, before any job, streamed or not (#57 item 6)."""
    if isinstance(value, dict):
        try:
            jsonschema.validators.validator_for(value, default=jsonschema.Draft202012Validator).check_schema(value)
        except jsonschema.SchemaError as bad:
            where = "/".join(str(part) for part in bad.path)
            raise _invalid(field, f"not a valid JSON Schema{f' at {where}' if where else ''}: {bad.message}") from None
    return value


def _one(found: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if len(found) > 1:
        raise _invalid(sorted(found)[1], f"one constraint per request: {', '.join(sorted(found))} given")
    return next(iter(found.values()), None)


def _invalid(field: str, message: str) -> InvalidGrammarError:
    return InvalidGrammarError(f"invalid {field}: {message}", errors={field: [message]})
