"""transmuter_jax: run Hugging Face ONNX models as compiled JAX programs."""

from .onnx import (
    DynamicShapeError,
    InputError,
    Model,
    ModelFileError,
    TransmuterError,
    UnsupportedOpError,
    ValueInfo,
    load,
)

__all__ = [
    "DynamicShapeError",
    "InputError",
    "Model",
    "ModelFileError",
    "TransmuterError",
    "UnsupportedOpError",
    "ValueInfo",
    "load",
]
__version__ = "0.1.0"
