"""transmuter_jax: run Hugging Face ONNX models as compiled JAX programs."""

from . import compile_cache
from .onnx import (
    DynamicShapeError,
    GraphError,
    InputError,
    Model,
    ModelFileError,
    TransmuterError,
    UnsupportedOpError,
    ValueInfo,
    load,
)

__all__ = [
    "compile_cache",
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
__version__ = "0.1.0"
