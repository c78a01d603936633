"""Helpers shared by the op implementations."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax
import numpy as np

from ..dtypes import device_dtype, np_dtype
from ..fold import xp  # noqa: F401  (re-exported for the op modules)


def ints(value: Any) -> list[int]:
    """A static integer array (shape, axes, pads) as a list of Python ints."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


def onnx_dtype(to: int, module: ModuleType = np) -> np.dtype:
    """The dtype of ONNX element type ``to``; with jax.numpy, the device dtype."""
    dtype = np_dtype(to)
    return dtype if module is np else device_dtype(dtype)


def precision() -> jax.lax.Precision | None:
    """The precision of float matrix products: full float32 everywhere.

    On CPU the default already is full float32 (and asking for HIGHEST picks a slower kernel); on
    GPU and TPU the default may round the inputs to TF32 or bfloat16, so ask for HIGHEST there.
    """
    return None if jax.default_backend() == "cpu" else jax.lax.Precision.HIGHEST
