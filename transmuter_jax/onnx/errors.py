"""Errors raised while loading and tracing ONNX models."""

from __future__ import annotations


class TransmuterError(Exception):
    """Base class of the errors of transmuter_jax."""


class ModelFileError(TransmuterError, ValueError):
    """The ONNX file or its external data cannot be read or is not allowed."""


class UnsupportedOpError(TransmuterError, NotImplementedError):
    """The graph uses an operator that has no implementation."""


class DynamicShapeError(TransmuterError, ValueError):
    """A value that fixes a shape is only known when the graph runs."""


class InputError(TransmuterError, ValueError):
    """An input of the model is missing, unknown or of the wrong type or shape."""


class GraphError(TransmuterError, ValueError):
    """The graph is malformed, or an op of it gets inputs or attributes it cannot take."""
