"""Chat messages as HF chat templates read them, and their media as job ``content_parts``.

Free of torch and of the processor: the API checks and converts messages with it, and
``processors.render`` renders them into token ids on a CPU worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import InvalidRequestError

MAX_UUID_LENGTH = 256


# Chat part type -> the modality (and the HF template's part type).
_MEDIA_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio", "input_audio": "audio"}
_AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac", "ogg": "audio/ogg"}


def _media_url(part: Mapping[str, Any]) -> str | None:
    """The part's URL: ``{kind: {"url": ...}}``, or OpenAI's ``input_audio`` (base64 ``data`` and
    a ``format``) as a data: URL; None when the part is malformed."""
    kind = part["type"]
    body = part.get(kind)
    if not isinstance(body, Mapping):
        return None
    if kind == "input_audio":
        data, fmt = body.get("data"), body.get("format")
        if not isinstance(data, str) or fmt not in _AUDIO_FORMATS:
            return None
        return f"data:{_AUDIO_FORMATS[fmt]};base64,{data}"
    return body["url"] if isinstance(body.get("url"), str) else None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[dict]]:
    """Messages the way HF chat templates read them (an image is ``{"type": "image"}``, a video
    ``{"type": "video"}``, audio ``{"type": "audio"}``), and the media as job ``content_parts``,
    in order."""
    if not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out, parts = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a role")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts")
        converted = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            url = _media_url(part) if isinstance(kind, str) and kind in _MEDIA_PARTS else None
            if kind == "text" and isinstance(part.get("text"), str):
                converted.append({"type": "text", "text": part["text"]})
            elif url is not None:
                _check_uuid(part.get("uuid"), f"messages[{i}].content[{j}].uuid")
                converted.append({"type": _MEDIA_PARTS[kind]})
                parts.append({"type": f"{_MEDIA_PARTS[kind]}_url", "url": url,
                              **({"uuid": part["uuid"]} if part.get("uuid") is not None else {})})
            else:
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] must be a text part, an image_url, video_url or audio_url "
                    "part with a url, or an input_audio part with base64 data and its format"
                )
        out.append({"role": message["role"], "content": converted})
    return out, parts


def _check_uuid(value: Any, path: str) -> None:
    # As a job's content part takes it (web.api.schemas.ContentPartSchema): a string of 1..256.
    if value is not None and not (isinstance(value, str) and 1 <= len(value) <= MAX_UUID_LENGTH):
        raise InvalidRequestError(f"{path} must be a string of 1 to {MAX_UUID_LENGTH} characters",
                                  errors={path: ["Not a valid string."]})
