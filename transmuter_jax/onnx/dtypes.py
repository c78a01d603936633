"""ONNX element types, numpy dtypes and the dtypes JAX uses with x64 off."""

from __future__ import annotations

import numpy as np
from onnx import helper

INT32 = np.iinfo(np.int32)


def np_dtype(onnx_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type (``TensorProto.FLOAT`` -> float32)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(onnx_type))


def device_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a value of ``dtype`` has on the device with x64 off."""
    dtype = np.dtype(dtype)
    return {
        np.dtype(np.int64): np.dtype(np.int32),
        np.dtype(np.uint64): np.dtype(np.uint32),
        np.dtype(np.float64): np.dtype(np.float32),
        np.dtype(np.complex128): np.dtype(np.complex64),
    }.get(dtype, dtype)


def fits_device(array: np.ndarray) -> bool:
    """Whether ``array`` keeps its values when converted to its device dtype."""
    target = device_dtype(array.dtype)
    if target == array.dtype or array.size == 0:
        return True
    if np.issubdtype(target, np.integer):
        info = np.iinfo(target)
        return bool(array.min() >= info.min and array.max() <= info.max)
    return True


def to_device_dtype(array: np.ndarray) -> np.ndarray:
    """``array`` converted to its device dtype; int64 values must fit in int32."""
    target = device_dtype(array.dtype)
    if target == array.dtype:
        return array
    if not fits_device(array):
        raise OverflowError(f"values of dtype {array.dtype} do not fit in {target}")
    return array.astype(target)
