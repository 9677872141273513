"""file: URLs, served only from inside the policy's media_root."""

from __future__ import annotations

import mimetypes
import os
import stat
from pathlib import Path
from urllib.parse import unquote

from .errors import MediaBlockedError, MediaRejectedError, MediaTooLargeError
from .media import FetchedMedia
from .policy import FetchPolicy
from .urls import ParsedURL


def read_file_url(url: ParsedURL, policy: FetchPolicy) -> FetchedMedia:
    root = policy.media_root
    if root is None:
        raise MediaBlockedError("file: URLs are not enabled", reason="file_path")
    if url.host not in (None, "localhost"):
        raise MediaBlockedError("file: URLs must name a local path", reason="file_path")
    text = unquote(url.path)  # "%2e%2e" becomes ".." here, and realpath then resolves it
    if "\x00" in text or not text.startswith("/"):
        raise MediaBlockedError("the file: URL's path is not an absolute path", reason="file_path")
    # realpath resolves "..", every symlink and every "%2e%2e" decoded above; the containment
    # check runs on that final path, so nothing that leads outside the root is opened.
    resolved = Path(os.path.realpath(text))
    if not resolved.is_relative_to(root):
        raise MediaBlockedError("the file: URL points outside the media root", reason="file_path")
    try:
        # O_NOFOLLOW: a symlink swapped in after realpath is refused rather than followed;
        # O_NONBLOCK: a FIFO cannot block the open (it is refused just below).
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise MediaRejectedError("no such media file") from None
    except OSError:
        raise MediaBlockedError("the media file cannot be opened", reason="file_path") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaBlockedError("the file: URL is not a regular file", reason="file_path")
        limit = policy.max_bytes
        if info.st_size > limit:
            raise MediaTooLargeError(f"the media is larger than {limit} bytes")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise MediaTooLargeError(f"the media is larger than {limit} bytes")
    return FetchedMedia(data, mimetypes.guess_type(resolved.name)[0], resolved.as_uri())
