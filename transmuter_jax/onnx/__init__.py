"""The ONNX frontend: load an ONNX file as a jitted JAX function."""

from .errors import (
    DynamicShapeError,
    InputError,
    ModelFileError,
    TransmuterError,
    UnsupportedOpError,
)
from .model import CompileStat, Model, ValueInfo, load

__all__ = [
    "CompileStat",
    "DynamicShapeError",
    "InputError",
    "Model",
    "ModelFileError",
    "TransmuterError",
    "UnsupportedOpError",
    "ValueInfo",
    "load",
]
