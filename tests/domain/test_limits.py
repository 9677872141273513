"""One Limits object (#50 item 2): built from the settings and the model's context, with the
same values an engine or a pipeline built without settings takes, so no layer's defaults drift
from the service's (SchedulerLimits' 16 rows against the settings' 128, the pipeline's 32 media
parts and 16-megapixel images against 16 and 40)."""

from __future__ import annotations

from dataclasses import fields

from domain.limits import build_limits
from domain.settings import Settings
from engine.limits import Limits, MediaLimits


def test_the_defaults_of_every_layer_are_the_settings_defaults(tmp_path):
    built = build_limits(Settings(state_dir=tmp_path), model_context=None)
    assert built == Limits()
    # max_feature_bytes has no setting (256 MiB of precomputed features a request): the one default.
    named = {f.name for f in fields(MediaLimits)} - {"max_feature_bytes"}
    assert all(getattr(built.media, name) == getattr(Settings(state_dir=tmp_path), settings_name(name))
               for name in named)


def settings_name(media_field: str) -> str:
    return {"max_items": "max_content_parts"}.get(media_field, media_field)


def test_the_context_limit_is_the_configured_one_never_past_the_models(tmp_path):
    assert build_limits(Settings(state_dir=tmp_path), 4096).context_tokens == 4096
    assert build_limits(Settings(state_dir=tmp_path, max_model_len=100), 4096).context_tokens == 100
    assert build_limits(Settings(state_dir=tmp_path, max_model_len=10**6), 4096).context_tokens == 4096
    assert build_limits(Settings(state_dir=tmp_path), None).context_tokens is None
