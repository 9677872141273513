"""The typed refusals of adapters (each a code, its status by its fault: domain/error_statuses.py)."""

from __future__ import annotations

from engine.errors import Fault, InvalidRequestError, NotFoundError, RolloutError


class AdapterInvalidError(InvalidRequestError):
    """An adapter directory that cannot serve on this base; ``errors["problem"]`` says why
    (``missing_file``, ``bad_config``, ``unsupported``, ``unknown_module``, ``encoder_module``,
    ``shape_mismatch``, ``rank_too_large``, ``non_finite``, ``outside_root``, ...)."""

    code = "adapter_invalid"

    def __init__(self, message: str, *, problem: str, **details):
        super().__init__(message, errors={"problem": problem, **details})
        self.problem = problem


class AdapterNotFoundError(NotFoundError):
    """A request names an adapter that is not loaded (never, or no longer): never the base's answer."""

    code = "adapter_not_found"


class AdapterLimitError(RolloutError):
    """No room for another adapter: the engine's resident slots, or the key's cap."""

    code = "adapter_limit_reached"
    fault = Fault.CONFLICT
