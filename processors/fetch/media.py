"""What the fetcher hands back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FetchedMedia:
    data: bytes
    content_type: str | None
    # Where the bytes came from: the last hop after redirects; a file: URL of the resolved path;
    # for data: URLs the URL without its payload.
    url: str


@dataclass(frozen=True)
class OutboundResponse:
    status: int
    headers: dict[str, str]
    body: bytes  # at most the post cap; longer bodies are cut, not refused
    elapsed: float  # seconds, from resolving the host to the end of the body read
