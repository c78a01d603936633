"""Vision tasks: image to text (VisionEncoderDecoder models) and image and text to text
(SmolVLM / Idefics3). See docs/vision.md."""

from .image_text_to_text import ImageTextToText
from .image_to_text import ImageToText, image_to_text
from .images import ImageError, load_image
from .processing import (
    BeitImageProcessor,
    DeiTImageProcessor,
    ViTImageProcessor,
    image_processor,
)
from .vlm import image_text_to_text

__all__ = [
    "ImageError",
    "ImageTextToText",
    "ImageToText",
    "BeitImageProcessor",
    "DeiTImageProcessor",
    "ViTImageProcessor",
    "image_processor",
    "image_text_to_text",
    "image_to_text",
    "load_image",
]
