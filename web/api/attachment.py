"""``Content-Disposition: attachment`` for a name a client chose (RFC 6266): any name is a valid header.

An uploaded file's name may hold non-ASCII characters, quotes, NUL, CR or LF; written raw into the
header it was a 500 (werkzeug refuses a header with a newline) or a header others could forge. The
name goes as ``filename*`` (RFC 5987, UTF-8, percent-encoded), with an ASCII ``filename`` beside it
for old clients, made as Flask's ``send_file`` makes its ``download_name`` fallback.
"""

from __future__ import annotations

import unicodedata
from urllib.parse import quote


def attachment(filename: str) -> str:
    printable = "".join(ch for ch in filename if unicodedata.category(ch)[0] != "C")  # no NUL, CR, LF, ...
    fallback = unicodedata.normalize("NFKD", printable).encode("ascii", "ignore").decode("ascii")
    fallback = fallback.replace("\\", "_").replace('"', "_").strip() or "download"
    if fallback == printable:
        return f'attachment; filename="{fallback}"'
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(printable, safe='')}"
