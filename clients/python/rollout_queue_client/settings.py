"""The client's own configuration, read from the environment here and nowhere else in this package.

    ROLLOUT_URL      the service (default http://127.0.0.1:8000)
    ROLLOUT_API_KEY  the API key sent as ``Authorization: Bearer``

Plain ``os.environ`` rather than the service's environs-based settings: the client needs only
``requests`` and the standard library, and it must not import the service's packages.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_URL = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class ClientSettings:
    url: str = DEFAULT_URL
    api_key: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSettings:
        env = os.environ if environ is None else environ
        return cls(url=env.get("ROLLOUT_URL") or DEFAULT_URL, api_key=env.get("ROLLOUT_API_KEY") or None)
