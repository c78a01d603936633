"""The error of generation's refusals."""

from __future__ import annotations

from ..onnx.errors import TransmuterError


class GenerationError(TransmuterError, ValueError):
    """A generation option, prompt or input that generation refuses, named with what is wrong
    (raised before any cache is allocated or program compiled)."""
