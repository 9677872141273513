"""The one tree of typed errors.

Every error a user can see derives from :class:`RolloutError` and carries a stable ``code``,
its :class:`Fault` (what kind of failure it is) and whether retrying may help (``retryable``).
No protocol is named here: the layers that answer a caller map a fault to their status
(domain/error_statuses.py: the API's HTTP statuses and the OpenAI batch output's). Code
branches on the type, ``code`` or ``fault``, never on message text. It lives in ``engine`` because
that is the lowest layer: every other layer may import it.

    RolloutError
    ├── InvalidRequestError (invalid)
    │   ├── PlaceholderMismatchError
    │   ├── ContextLengthError
    │   ├── TokenIdOutOfRangeError
    │   ├── CapacityError
    │   ├── NonFiniteOutputError
    │   ├── ModelLoadError
    │   └── InvalidFeaturesError, UnsupportedModalityError  (processors.errors)
    ├── NotFoundError (not_found)
    ├── UnauthorizedError (unauthenticated)
    ├── ForbiddenError (forbidden)
    ├── PayloadTooLargeError (too_large)
    ├── RateLimitedError (rate_limited)
    ├── ServiceUnavailableError (unavailable)
    │   └── ModelFidelityError
    ├── JobTimeoutError (deadline_exceeded)
    ├── MediaError (invalid; processors.fetch.errors adds the media tree)
    ├── TransportError (internal)
    │   ├── HandleUnavailableError
    │   └── WrappedFeatureAccessError
    └── InternalError (internal, message never shows the cause)
        └── UnsupportedModelError, ItemLayoutError  (processors.errors)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, ClassVar


class Fault(enum.Enum):
    """What kind of failure an error is, whoever reports it (gRPC's canonical codes draw the same
    lines, with ours apart where an HTTP client must tell them apart: unreadable from refused)."""

    MALFORMED = "malformed"  # the request cannot be read (bad JSON, a bad header)
    INVALID = "invalid"  # read, and refused as it stands
    UNAUTHENTICATED = "unauthenticated"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    CONFLICT = "conflict"  # refused in the state things are in (another body under a key, a busy swap)
    GONE = "gone"  # existed, and no longer can be read
    TOO_LARGE = "too_large"
    RATE_LIMITED = "rate_limited"
    CANCELLED = "cancelled"  # the caller went away first
    UNAVAILABLE = "unavailable"  # may succeed later (retryable)
    DEADLINE_EXCEEDED = "deadline_exceeded"
    INTERNAL = "internal"


class RolloutError(Exception):
    code: ClassVar[str] = "internal_error"
    fault: ClassVar[Fault] = Fault.INTERNAL
    retryable: ClassVar[bool] = False
    # code -> the first class that declares it: a stored error's type (and so its status) comes back
    # from its code alone (see from_record).
    _by_code: ClassVar[dict[str, type[RolloutError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            RolloutError._by_code.setdefault(cls.code, cls)

    @staticmethod
    def from_record(error: Mapping[str, Any]) -> RolloutError:
        """The typed error a stored ``{code, message, errors}`` (a failed job's ``error``) stands
        for: its class is found by its code, so ``fault`` and ``retryable`` are the type's own.
        Only the base fields come back (``message``, ``errors``); a code no class declares (a
        newer worker's) is an :class:`InternalError`."""
        kind = RolloutError._by_code.get(error.get("code"), InternalError)
        restored = Exception.__new__(kind)
        RolloutError.__init__(restored, str(error.get("message") or "job failed"), errors=error.get("errors"))
        return restored

    def __init__(self, message: str, *, errors: Any = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.errors = errors
        self.headers = headers or {}

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.errors is not None:
            body["errors"] = self.errors
        return body


class InvalidRequestError(RolloutError):
    code = "invalid_request"
    fault = Fault.INVALID


class PlaceholderMismatchError(InvalidRequestError):
    """The prompt's media placeholders do not match its media items."""

    code = "placeholder_mismatch"

    def __init__(self, message: str, *, placeholders: int, items: int):
        super().__init__(message, errors={"placeholders": placeholders, "items": items})
        self.placeholders = placeholders
        self.items = items


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class TokenIdOutOfRangeError(InvalidRequestError):
    """A token id the model does not have (or not an integer). Caught before the embedding: there
    it would raise an untyped IndexError, or on CUDA a device-side assert that breaks the worker
    process for every later request."""

    code = "token_id_out_of_range"

    def __init__(self, *, field: str, index: int, token_id: object, vocab_size: int):
        super().__init__(
            f"{field}[{index}] is not a token id of this model (an integer in 0..{vocab_size - 1})",
            errors={"field": field, "index": index, "vocab_size": vocab_size},
        )
        self.field = field
        self.index = index
        self.token_id = token_id
        self.vocab_size = vocab_size


def check_token_ids(token_ids, vocab_size: int, field: str) -> None:
    """Raise :class:`TokenIdOutOfRangeError` for the first id of ``token_ids`` that is not an
    integer in ``0..vocab_size - 1``. Here, the lowest layer, so the API and the engine check
    alike."""
    if isinstance(token_ids, list | tuple) and (not token_ids or (
            set(map(type, token_ids)) == {int} and min(token_ids) >= 0 and max(token_ids) < vocab_size)):
        return  # every valid request, in C loops; the loop below finds the first bad id of the others
    for index, token in enumerate(token_ids):
        if type(token) is not int or not 0 <= token < vocab_size:
            raise TokenIdOutOfRangeError(field=field, index=index, token_id=token, vocab_size=vocab_size)


class CapacityError(InvalidRequestError):
    """The request can never fit the GPU worker's running batch (its rows or its KV-cache budget)."""

    code = "request_exceeds_capacity"


class KVPoolExhausted(CapacityError):
    """The GPU worker's KV pool had no free block for a running row (engine/paged_kv.py; admission
    counts blocks, so this means a bug, not a request too large)."""

    code = "kv_pool_exhausted"


class NonFiniteOutputError(InvalidRequestError):
    """The model's forward gave NaN or infinite logits for this request's row (its inputs made the
    model overflow: features of absurd magnitude, an fp16/bf16 overflow). The row ends alone, its
    KV is never reused, and its blocks are cleared before anyone else gets them."""

    code = "non_finite_output"


class ModelLoadError(InvalidRequestError):
    """The model path or hub id does not name a loadable model (missing, empty or unsupported)."""

    code = "model_load_failed"


class NotFoundError(RolloutError):
    code = "not_found"
    fault = Fault.NOT_FOUND


class UnauthorizedError(RolloutError):
    code = "unauthorized"
    fault = Fault.UNAUTHENTICATED


class ForbiddenError(RolloutError):
    """A valid key that may not do this (weight updates and pausing need an admin key)."""

    code = "forbidden"
    fault = Fault.FORBIDDEN


class PayloadTooLargeError(RolloutError):
    code = "payload_too_large"
    fault = Fault.TOO_LARGE


class RateLimitedError(RolloutError):
    code = "rate_limited"
    fault = Fault.RATE_LIMITED
    retryable = True


class ServiceUnavailableError(RolloutError):
    code = "service_unavailable"
    fault = Fault.UNAVAILABLE
    retryable = True


class ModelFidelityError(ServiceUnavailableError):
    """The loaded model failed its load-time fidelity check (``engine/fidelity.py``): the logprobs the
    engine would return differ from the model's own forward, so its worker takes no work."""

    code = "model_fidelity_failed"


class JobTimeoutError(RolloutError):
    code = "job_time_limit_exceeded"
    fault = Fault.DEADLINE_EXCEEDED


class MediaError(RolloutError):
    """Base of the media fetching and decoding errors (see ``processors.fetch``)."""

    code = "media_error"
    fault = Fault.INVALID


class TransportError(RolloutError):
    code = "transport_error"
    fault = Fault.INTERNAL


class HandleUnavailableError(TransportError):
    """A feature handle cannot be opened (producer gone or memory reclaimed): re-preprocess."""

    code = "handle_unavailable"
    retryable = True


class WrappedFeatureAccessError(TransportError):
    """Code indexed, sliced or computed on a feature already wrapped for transport (a bug).

    Wrapping is the last step of finalizing an item; reshape and slice before it, or open the
    handle with ``engine.transport.open_feature`` first.
    """

    code = "wrapped_feature_access"


class InternalError(RolloutError):
    code = "internal_error"
    fault = Fault.INTERNAL
