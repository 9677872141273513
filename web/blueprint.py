"""The blueprint every API module uses: flask-smorest's, with request bodies parsed by
``web.serving.json_body`` (the parser is bound when a view is decorated, so it is set on the class), and
each route's argument schema built once."""

from __future__ import annotations

import flask_smorest
from flask_smorest.utils import resolve_schema_instance

from web.serving.json_body import BodyParser


class Blueprint(flask_smorest.Blueprint):
    ARGUMENTS_PARSER = BodyParser()

    def arguments(self, schema, *args, **kwargs):
        # Given a schema class, webargs builds an instance on every request: each field deep-copied
        # and every nested schema built again: ~9 % of a POST /v1/jobs (bench/argument_schemas.py).
        # One instance per route serves every request: marshmallow's load keeps no state on it.
        return super().arguments(resolve_schema_instance(schema), *args, **kwargs)
