"""transmuter_jax: run Hugging Face ONNX models as compiled JAX programs."""

from .onnx import (
    DynamicShapeError,
    GraphError,
    InputError,
    Model,
    ModelFileError,
    TransmuterError,
    UnsupportedOpError,
    ValueInfo,
)
from .parallel import load
from .runtime import compile_cache

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
