"""Errors raised while loading and tracing ONNX models."""

from __future__ import annotations

from ..runtime.errors import ModelFileError, TransmuterError

__all__ = [
    "DynamicShapeError",
    "GraphError",
    "InputError",
    "ModelFileError",
    "TransmuterError",
    "UnsupportedOpError",
]


class UnsupportedOpError(TransmuterError, NotImplementedError):
    """The graph uses an operator that has no implementation."""


class DynamicShapeError(TransmuterError, ValueError):
    """A value that fixes a shape is only known when the graph runs."""


class InputError(TransmuterError, ValueError):
    """An input of the model is missing, unknown or of the wrong type or shape."""


class GraphError(TransmuterError, ValueError):
    """The graph is malformed, or an op of it gets inputs or attributes it cannot take."""
