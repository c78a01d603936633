"""Loading images: a path, raw bytes, a ``PIL.Image`` or a numpy array, to an RGB ``PIL.Image``.

Loading follows transformers' image pipelines (``transformers.image_utils.load_image``): the EXIF
orientation is applied, then the image is converted with Pillow's ``convert("RGB")``, so
grayscale is repeated over the three channels, a palette is looked up and an alpha channel is
dropped (not blended).
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import numpy as np

from ..runtime.paths import not_a_file

ImageInput = Any
"""A path (str or os.PathLike), bytes, a PIL.Image.Image, or a numpy uint8 array (HW or HWC)."""


class ImageError(ValueError):
    """An image that cannot be used: unreadable, corrupt, empty (0 pixels), or of a wrong type."""


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _open(Image: Any, source: Any, where: str, verb: str) -> Any:
    """The loaded PIL image of a file or stream; ImageError naming ``where`` when Pillow cannot
    read it, or it has more pixels than Pillow's decompression-bomb limit (kept as set)."""
    from PIL import UnidentifiedImageError

    try:
        image = Image.open(source)
        image.load()
    except Image.DecompressionBombError as error:
        raise ImageError(
            f"{where} {verb} an image of more pixels than Pillow's limit of "
            f"{Image.MAX_IMAGE_PIXELS:,} (a decompression bomb?): {error}"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as error:
        why = type(error).__name__ if isinstance(error, UnidentifiedImageError) else error
        raise ImageError(f"{where} {verb} not a readable image file: {why}") from None
    return image


def pil():
    """The PIL.Image module; ImportError with the install line when Pillow is missing."""
    try:
        from PIL import Image
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "transmuter_jax.vision needs Pillow: pip install 'transmuter_jax[vision]'"
        ) from error
    return Image


def load_image(image: ImageInput) -> Any:
    """The RGB ``PIL.Image`` of ``image``, as transformers' pipelines load it.

    Args:
        image: a file path, the bytes of an image file, a ``PIL.Image.Image``, or a numpy uint8
            array of shape (height, width) or (height, width, channels) with 1, 3 or 4 channels.

    Raises:
        ImageError: a missing, unreadable or corrupt file, an array of another shape or dtype,
            or an image with no pixels.
        TypeError: ``image`` is none of the above.
    """
    Image = pil()
    from PIL import ImageOps

    where = "the image"
    if isinstance(image, str | os.PathLike):
        where = repr(os.fspath(image))
        if isinstance(image, str) and _URL.match(image):
            raise ImageError(
                f"{where} is a URL; images are never fetched: download it and pass the file"
            )
        why = not_a_file(image, "an image")
        if why is not None:
            raise ImageError(why)
        image = _open(Image, image, where, "is")
    elif isinstance(image, bytes | bytearray | memoryview):
        where = f"the {len(image)} bytes given"
        image = _open(Image, io.BytesIO(bytes(image)), where, "are")
    elif isinstance(image, np.ndarray):
        image = _from_array(image)
    elif not isinstance(image, Image.Image):
        raise TypeError(
            "an image is a path, bytes, a PIL.Image or a numpy uint8 array (HWC), "
            f"not {type(image).__name__}"
        )
    if image.width == 0 or image.height == 0:
        raise ImageError(f"{where} has no pixels ({image.width}x{image.height})")
    try:
        image = ImageOps.exif_transpose(image)
        return image.convert("RGB")
    except (OSError, ValueError) as error:
        raise ImageError(f"{where} cannot be converted to RGB: {error}") from error


def _from_array(array: np.ndarray) -> Any:
    """A PIL image of a uint8 array of shape (H, W) or (H, W, C), C in 1, 3, 4."""
    Image = pil()
    if array.dtype != np.uint8:
        raise ImageError(f"an image array must be uint8 (0-255), not {array.dtype}")
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim != 2 and not (array.ndim == 3 and array.shape[-1] in (3, 4)):
        raise ImageError(
            f"an image array has shape (height, width) or (height, width, 1|3|4), not {array.shape}"
        )
    if array.shape[0] == 0 or array.shape[1] == 0:
        raise ImageError(f"the image array has no pixels (shape {array.shape})")
    return Image.fromarray(np.ascontiguousarray(array))  # L, RGB or RGBA
