"""Text tasks: text generation (text or chat in, text out) and text-to-text (encoder-decoder).

See docs/text.md.
"""

from ..tasks.detect import WrongTask
from ..tasks.runner import Result
from .generation import TextGeneration, generation
from .text_to_text import TextToText, text_to_text

__all__ = ["Result", "TextGeneration", "TextToText", "WrongTask", "generation", "text_to_text"]
