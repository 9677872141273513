"""The blueprint every API module uses: flask-smorest's, with request bodies parsed by
``web.json_body`` (the parser is bound when a view is decorated, so it is set on the class)."""

from __future__ import annotations

import flask_smorest

from web.json_body import BodyParser


class Blueprint(flask_smorest.Blueprint):
    ARGUMENTS_PARSER = BodyParser()
