"""JSON that strict parsers take: no ``NaN`` or ``Infinity`` ever leaves the service.

Python's ``json.dumps`` writes non-finite floats as the bare words ``NaN`` and ``Infinity``, which
JavaScript, Go and serde refuse. Requests carrying them are refused on input; a non-finite number
made inside the service (a model that produced a NaN logprob) is written as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps``, with every non-finite float as ``null``; free when there is none."""
    try:
        return json.dumps(value, allow_nan=False, **kwargs)
    except ValueError:  # a non-finite float somewhere: rebuild the value without it
        return json.dumps(finite(value), allow_nan=False, **kwargs)


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value
