"""Helpers shared by the op implementations."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..dtypes import device_dtype, np_dtype


def xp(*values: Any) -> ModuleType:
    """numpy when every value is known at trace time (numpy or None), else jax.numpy.

    Ops written against ``xp(...)`` fold shape arithmetic exactly (int64 included) with numpy and
    trace everything else with JAX.
    """
    if all(v is None or isinstance(v, (np.ndarray, np.generic, int, float, bool)) for v in values):
        return np
    return jnp


def ints(value: Any) -> list[int]:
    """A static integer array (shape, axes, pads) as a list of Python ints."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


def onnx_dtype(to: int, module: ModuleType = np) -> np.dtype:
    """The dtype of ONNX element type ``to``; with jax.numpy, the device dtype."""
    dtype = np_dtype(to)
    return dtype if module is np else device_dtype(dtype)
