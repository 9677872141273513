"""Which directories a weight update may name: only those under ``ROLLOUT_WEIGHTS_ROOT``.

A weight update's ``model_path`` is read by every GPU worker, so it is checked like a ``file:``
media URL (``processors/fetch/files.py``): the API checks it before it sets a target, and each
worker checks it again before it reads (a target in Redis is not trusted blindly). ``..`` is
refused outright, then ``realpath`` resolves every symlink and the containment check runs on the
final path, so a symlink inside the root that leads out of it is refused too. The check is a
path's: what is read afterwards goes through ``engine.checkpoint_dir.CheckpointDir`` opened under
the root, which meets no symlink and reads regular files only, so a swap after the check is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import Fault, InvalidRequestError, RolloutError


class WeightsPathError(InvalidRequestError):
    """``model_path`` is not a directory under the weights root."""

    code = "weights_path_refused"


class WeightUpdatesDisabledError(RolloutError):
    """No ``ROLLOUT_WEIGHTS_ROOT``: weight updates are off."""

    code = "weight_updates_disabled"
    fault = Fault.CONFLICT


def resolve_weights_dir(model_path: str, root: Path | None) -> Path:
    """The resolved directory ``model_path`` names (absolute, or relative to ``root``)."""
    if root is None:
        raise WeightUpdatesDisabledError("weight updates are not enabled: set ROLLOUT_WEIGHTS_ROOT")
    if not isinstance(model_path, str) or not model_path or "\x00" in model_path:
        raise WeightsPathError("model_path must be a directory path", errors={"model_path": ["not a path"]})
    if ".." in Path(model_path).parts:
        raise WeightsPathError("model_path must not contain '..'", errors={"model_path": ["contains '..'"]})
    real_root = Path(os.path.realpath(root))
    candidate = Path(model_path) if os.path.isabs(model_path) else real_root / model_path
    resolved = Path(os.path.realpath(candidate))
    if not resolved.is_relative_to(real_root):
        raise WeightsPathError("model_path is outside ROLLOUT_WEIGHTS_ROOT",
                               errors={"model_path": ["outside the weights root"]})
    try:
        is_dir = resolved.is_dir()
    except OSError:  # a name past the file system's limits (ENAMETOOLONG), a loop: no directory
        is_dir = False
    if not is_dir:
        raise WeightsPathError("model_path is not a directory", errors={"model_path": ["not a directory"]})
    return resolved
