"""Helpers shared by the op implementations."""

from __future__ import annotations

from types import ModuleType
from typing import Any

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
