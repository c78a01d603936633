"""Reductions, ArgMax/ArgMin, CumSum and TopK against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_cases import check_op

rng = np.random.default_rng(0)

REDUCE = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceSumSquare",
]
INT_REDUCE = ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"]


def floats(*shape, lo=-2.0, hi=2.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def ints(*shape, lo=-5, hi=5, dtype=np.int64):
    return rng.integers(lo, hi, shape).astype(dtype)


def reduce(name, data, axes, opset, *, const_data=False, **attrs):
    """Checks ``name`` over ``axes`` (None: omitted), as an attribute or an input per opset."""
    axes_input = opset >= (13 if name == "ReduceSum" else 18)
    constants = ("data",) if const_data else ()
    if axes_input:
        value = None if axes is None else np.asarray(axes, np.int64)
        inputs = {"data": data, "axes": value}
        check_op(name, inputs, opset=opset, constants=(*constants, "axes"), **attrs)
    else:
        if axes is not None:
            attrs["axes"] = list(axes)
        check_op(name, {"data": data}, opset=opset, constants=constants, **attrs)


def _data(name):
    # Positive values keep the logarithms defined.
    if name in ("ReduceLogSum", "ReduceProd"):
        return floats(2, 3, 4, lo=0.5, hi=1.5)
    return floats(2, 3, 4)


@pytest.mark.parametrize("opset", [11, 13, 18, 20])
@pytest.mark.parametrize("name", REDUCE)
@pytest.mark.parametrize("axes", [None, (1,), (0, 2), (-1,), (-3, 1)], ids=str)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce(name, opset, axes, keepdims):
    reduce(name, _data(name), axes, opset, keepdims=keepdims)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("name", REDUCE)
def test_reduce_noop_with_empty_axes(name, opset):
    opset = max(opset, 13 if name == "ReduceSum" else 18)  # comes with the axes input
    data = _data(name)
    reduce(name, data, None, opset, noop_with_empty_axes=1)
    reduce(name, data, [], opset, noop_with_empty_axes=1)
    reduce(name, data, [], opset, noop_with_empty_axes=0)
    reduce(name, data, [1], opset, noop_with_empty_axes=1, keepdims=0)


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("name", INT_REDUCE)
def test_reduce_int(name, opset):
    reduce(name, ints(2, 3, 4), (1,), opset)
    reduce(name, ints(2, 3, 4), None, opset, keepdims=0)
    reduce(name, ints(2, 3, 4), (0, 2), opset, const_data=True)  # folded in numpy int64


@pytest.mark.parametrize("name", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"])
def test_reduce_empty_set(name):
    reduce(name, np.zeros((2, 0, 4), np.float32), (1,), 18)


def test_reduce_max_bool():
    data = rng.random((3, 4)) < 0.5
    reduce("ReduceMax", data, (1,), 20)
    reduce("ReduceMin", data, (1,), 20)


@pytest.mark.parametrize("opset", [11, 12, 13])
@pytest.mark.parametrize("name", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_arg(name, opset, axis, keepdims):
    data = ints(3, 4, 5, lo=0, hi=3).astype(np.float32)  # ties
    check_op(name, {"x": data}, opset=opset, axis=axis, keepdims=keepdims)
    if opset >= 12:
        check_op(name, {"x": data}, opset=opset, axis=axis, keepdims=keepdims, select_last_index=1)
    check_op(name, {"x": ints(3, 4, 5)}, opset=opset, axis=axis, constants=("x",))


@pytest.mark.parametrize("opset", [11, 14])
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumsum(opset, exclusive, reverse, axis):
    attrs = {"exclusive": exclusive, "reverse": reverse, "opset": opset}
    a = np.array(axis, np.int64)
    check_op("CumSum", {"x": floats(3, 4), "axis": a}, constants=("axis",), **attrs)
    check_op("CumSum", {"x": ints(3, 4), "axis": a}, constants=("axis",), **attrs)
    check_op("CumSum", {"x": ints(3, 4), "axis": a}, constants=("x", "axis"), **attrs)


@pytest.mark.parametrize("opset,largest", [(10, None), (11, 1), (11, 0)])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_topk(opset, largest, axis):
    attrs = {"axis": axis, "opset": opset, "constants": ("k",)}
    if largest is not None:
        attrs["largest"] = largest
    k = np.array([2], np.int64)
    outputs = ("values", "indices")
    ties = ints(3, 4, 5, lo=0, hi=3).astype(np.float32)
    check_op("TopK", {"x": ties, "k": k}, outputs, **attrs)
    check_op("TopK", {"x": floats(3, 4, 5), "k": k}, outputs, **attrs)
    if opset >= 11:
        check_op("TopK", {"x": ints(3, 4, 5, lo=-3, hi=3), "k": k}, outputs, **attrs)


def test_topk_k_attribute():
    check_op("TopK", {"x": floats(3, 5)}, ("values", "indices"), opset=1, k=3)
