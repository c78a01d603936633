"""Vision tasks: image to text (VisionEncoderDecoder models). See docs/vision.md."""

from .image_to_text import ImageToText, image_to_text
from .images import ImageError, load_image
from .processing import ViTImageProcessor, image_processor

__all__ = [
    "ImageError",
    "ImageToText",
    "ViTImageProcessor",
    "image_processor",
    "image_to_text",
    "load_image",
]
