"""Image bytes to a fully loaded RGB Pillow image, within a format allowlist and a pixel cap."""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageFile

from engine.errors import InternalError
from processors.fetch.errors import MediaDecodeError, MediaTooLargeError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def decode_image(data: bytes, *, max_pixels: int, formats: tuple[str, ...] = IMAGE_FORMATS) -> Image.Image:
    # A truncated file must fail, not come back with grey rows; this switch is process-wide, so
    # refuse to decode at all if something else in the process turned it on.
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise InternalError("Pillow is set to accept truncated images (ImageFile.LOAD_TRUNCATED_IMAGES)")
    try:
        # Pillow's own bomb guard (Image.MAX_IMAGE_PIXELS) only warns below twice its limit; make
        # the warning an error too. The cap that matters is ours, checked from the header below.
        # (catch_warnings swaps process-wide filters; the only effect on another thread is that
        # its bomb warning would also be an error for this moment.)
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=list(formats)) as img:
                width, height = img.size
                if width * height > max_pixels:
                    raise MediaTooLargeError(
                        f"the image has {width}x{height} pixels, more than the cap of {max_pixels}"
                    )
                img.load()
                return img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaTooLargeError("the image declares more pixels than may be decoded") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        # UnidentifiedImageError (unknown or disallowed format) and truncation are OSErrors;
        # some plugins report corrupt headers as SyntaxError or ValueError.
        raise MediaDecodeError("the image cannot be decoded") from exc
