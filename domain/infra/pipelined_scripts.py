"""Many calls of Lua scripts in one pipeline: one round trip.

Written here because redis-py's pipeline runs ``SCRIPT EXISTS`` for the scripts it holds before
sending them (``Pipeline.load_scripts``): a second round trip on every call, and the GPU session
makes such calls each time jobs join or end. This pipeline sends ``EVALSHA`` as is; where Redis
answers ``NOSCRIPT`` (its script cache is empty after a restart or a failover), the script is
loaded and only those calls run again. A call answered ``NOSCRIPT`` did not run, so its second try
is its only run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

ScriptCall = tuple[Script, Sequence[Any], Sequence[Any]]  # (script, keys, args)


def run_scripts(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Each call's reply, in order; the first error a call got is raised, as ``Pipeline.execute``
    raises it."""
    replies = _send(client, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
            client.script_load(script.script)
        for i, reply in zip(missing, _send(client, [calls[i] for i in missing]), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def _send(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for script, keys, args in calls:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    return pipe.execute(raise_on_error=False)
