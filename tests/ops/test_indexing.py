"""Indexing ops against onnxruntime, over the opsets where they changed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op

rng = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-50, 50, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def i64(values):
    return np.asarray(values, np.int64)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_gather(opset, axis, dtype):
    indices = i64([[0, -1], [2, -3]])
    check_op("Gather", {"x": rand(3, 4, 3, dtype=dtype), "i": indices}, opset=opset, axis=axis)


def test_gather_scalar_index_on_shape():
    """Gather of a constant shape folds in int64 numpy."""
    check_op("Gather", {"x": i64([2, 3, 2**40]), "i": i64(-1)}, opset=13, constants=["x", "i"])


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(opset, axis):
    indices = i64([[0, -1], [1, -2]])
    check_op(
        "GatherElements", {"x": rand(3, 3, dtype=np.int64), "i": indices}, opset=opset, axis=axis
    )


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("batch_dims", [0, 1])
@pytest.mark.parametrize("k", [1, 2])
def test_gather_nd(opset, batch_dims, k):
    if opset < 12 and batch_dims:
        pytest.skip("batch_dims from opset 12")
    data = rand(2, 3, 4)
    indices = i64([[[1, -1], [0, 2]], [[-2, 0], [1, 1]]])[..., :k]
    kwargs = {"batch_dims": batch_dims} if opset >= 12 else {}
    check_op("GatherND", {"x": data, "i": indices}, opset=opset, **kwargs)


SCATTER_OPSETS = [(11, "none"), (16, "add"), (16, "mul"), (18, "max"), (18, "min"), (18, "none")]


@pytest.mark.parametrize(("opset", "reduction"), SCATTER_OPSETS)
def test_scatter_nd(opset, reduction):
    data = rand(4, 3)
    indices = i64([[1], [-1], [1]] if reduction != "none" else [[1], [-1]])
    updates = rand(len(indices), 3)
    kwargs = {} if opset < 16 else {"reduction": reduction}
    check_op("ScatterND", {"x": data, "i": indices, "u": updates}, opset=opset, **kwargs)


def test_scatter_nd_full_index_int64():
    data = rand(2, 3, dtype=np.int64)
    check_op("ScatterND", {"x": data, "i": i64([[0, -1], [1, 0]]), "u": i64([7, 8])}, opset=13)


@pytest.mark.parametrize(("opset", "reduction"), SCATTER_OPSETS)
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements(opset, reduction, axis):
    data = rand(3, 4)
    indices = i64([[0, -1, 1], [2, 0, -2]])
    if reduction == "none":
        indices = i64([[0, -1, 1], [2, 1, -3]]) if axis == 0 else i64([[0, -1, 1], [2, 1, 3]])
    kwargs = {} if opset < 16 else {"reduction": reduction}
    check_op(
        "ScatterElements",
        {"x": data, "i": indices, "u": rand(2, 3)},
        opset=opset,
        axis=axis,
        **kwargs,
    )


@pytest.mark.parametrize("opset", [9, 10])
def test_scatter(opset):
    indices = i64([[1, 0, 2], [0, 2, 1]])
    check_op("Scatter", {"x": rand(3, 3), "i": indices, "u": rand(2, 3)}, opset=opset, axis=0)


@pytest.mark.parametrize("opset", [9, 11])
@pytest.mark.parametrize("axis", [-1, 0, 1])
@pytest.mark.parametrize("dtype", [np.int64, np.float32])
def test_one_hot(opset, axis, dtype):
    indices = np.asarray([[0, 3, 9], [2, 1, 7]], dtype)
    if opset >= 11:
        indices[0, 0] = -2  # negative indices count from depth
    depth = np.asarray([5], dtype)  # onnxruntime has float indices with float depth only
    inputs = {"i": indices, "d": depth, "v": np.asarray([-1.0, 3.0], np.float32)}
    check_op("OneHot", inputs, opset=opset, axis=axis, constants=["d"])


@pytest.mark.parametrize("opset", [9, 13])
def test_non_zero_static(opset):
    x = np.asarray([[0, 1, 0], [2, 0, 3]], np.int64)
    check_op("NonZero", {"x": x}, opset=opset, constants=["x"])


def test_non_zero_small_input_is_static():
    """A small graph input feeding NonZero becomes a compile-time input."""
    check_op("NonZero", {"x": np.asarray([[0, 1], [2, 0]], np.float32)}, opset=13)


@pytest.mark.parametrize("opset", [9, 11])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress(opset, axis):
    if opset < 11 and axis is not None and axis < 0:
        pytest.skip("negative axis from opset 11")
    condition = np.asarray([True, False, True], bool)
    kwargs = {} if axis is None else {"axis": axis}
    check_op("Compress", {"x": rand(3, 3), "c": condition}, opset=opset, constants=["c"], **kwargs)


def test_compress_short_condition():
    check_op(
        "Compress",
        {"x": rand(4, 2), "c": np.asarray([False, True])},
        opset=11,
        axis=0,
        constants=["c"],
    )


@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_unique(sorted_, axis):
    x = np.asarray([[2, 1, 2], [0, 1, 0], [2, 1, 2]], np.float32)
    kwargs = {} if axis is None else {"axis": axis}
    check_op(
        "Unique",
        {"x": x},
        ("y", "idx", "inv", "cnt"),
        opset=11,
        constants=["x"],
        sorted=sorted_,
        **kwargs,
    )


@pytest.mark.parametrize("op_type", ["GatherND", "GatherElements"])
def test_gather_from_a_constant_table_by_input_indices(op_type):
    """A table known at trace time (a constant, as the exporters write bucketize's boundaries)
    indexed by traced indices is indexed as a JAX array, not a numpy one."""
    table = np.asarray([0.25, 0.5, 0.75], np.float32)
    kwargs = {}
    if op_type == "GatherND":
        indices = np.asarray([[[0], [2]], [[1], [-1]]], np.int64)
    else:
        table, indices = table[None].repeat(2, 0), np.asarray([[0, 2], [1, -1]], np.int64)
        kwargs["axis"] = 1
    check_op(op_type, {"x": table, "i": indices}, opset=13, constants=["x"], **kwargs)
