"""transmuter_jax: run Hugging Face ONNX models as compiled JAX programs.

The names below are imported when first used (PEP 562), so that importing the package (as the
command line's ``--help`` does) loads neither jax nor onnx.
"""

from __future__ import annotations

import importlib
from typing import Any

from .runtime.errors import ModelFileError, TransmuterError

# name -> the module that defines it
_LAZY = {
    "compile_cache": "transmuter_jax.runtime.compile_cache",
    "DynamicShapeError": "transmuter_jax.onnx.errors",
    "GraphError": "transmuter_jax.onnx.errors",
    "InputError": "transmuter_jax.onnx.errors",
    "UnsupportedOpError": "transmuter_jax.onnx.errors",
    "Model": "transmuter_jax.onnx.model",
    "ValueInfo": "transmuter_jax.onnx.model",
    "load": "transmuter_jax.parallel.loading",
}

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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'transmuter_jax' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name == "compile_cache" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
