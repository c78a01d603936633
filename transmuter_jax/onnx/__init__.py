"""The ONNX frontend: load an ONNX file as a jitted JAX function."""

from .errors import (
    DynamicShapeError,
    GraphError,
    InputError,
    ModelFileError,
    TransmuterError,
    UnsupportedOpError,
)
from .model import CompileStat, Model, ValueInfo, load

__all__ = [
    "CompileStat",
    "DynamicShapeError",
    "GraphError",
    "InputError",
    "Model",
    "ModelFileError",
    "TransmuterError",
    "UnsupportedOpError",
    "ValueInfo",
    "load",
]
