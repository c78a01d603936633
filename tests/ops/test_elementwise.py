"""Elementwise ops against onnxruntime: arithmetic, math, activations, logic, casts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto
from onnx_cases import check_op, node_model, run_jax

rng = np.random.default_rng(0)


def floats(*shape, lo=-3.0, hi=3.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def ints(*shape, lo=-10, hi=10, dtype=np.int64):
    return rng.integers(lo, hi, shape).astype(dtype)


def nonzero(*shape, dtype=np.int64):
    x = ints(*shape, lo=1, hi=7, dtype=dtype)
    return x * np.where(rng.random(shape) < 0.5, -1, 1).astype(dtype)


# Arithmetic


@pytest.mark.parametrize("opset", [7, 13, 14])
@pytest.mark.parametrize("name", ["Add", "Sub", "Mul", "Div"])
def test_arithmetic_float_broadcast(name, opset):
    check_op(name, {"a": floats(2, 3, 4), "b": floats(4) + 4}, opset=opset)
    check_op(name, {"a": floats(3, 1), "b": floats(1, 4) + 4}, opset=opset)


@pytest.mark.parametrize("opset", [7, 14])
@pytest.mark.parametrize("name", ["Add", "Sub", "Mul", "Div"])
def test_arithmetic_int(name, opset):
    check_op(name, {"a": ints(3, 4, lo=-50, hi=50), "b": nonzero(4)}, opset=opset)
    check_op(name, {"a": ints(3, 4, dtype=np.int32), "b": nonzero(3, 1, dtype=np.int32)})


@pytest.mark.parametrize("name", ["Add", "Sub", "Mul", "Div"])
def test_arithmetic_folded(name):
    # Both inputs known at trace time: computed exactly in numpy int64.
    inputs = {"a": ints(3, 4, lo=-50, hi=50), "b": nonzero(4)}
    check_op(name, inputs, constants=("a", "b"))


def test_div_int_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 6, -6, 0], np.int64)
    b = np.array([2, 2, -2, -2, 3, -3, 5], np.int64)
    check_op("Div", {"a": a, "b": b})
    check_op("Div", {"a": a, "b": b}, constants=("a", "b"))


@pytest.mark.parametrize("name", ["Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "Greater"])
def test_legacy_broadcast_axis(name):
    # Opset 6 broadcasting: b aligned with a from dimension ``axis``; onnxruntime has no
    # kernels that old, so compare with numpy.
    a, b = floats(2, 3, 4, lo=0.5), floats(3, lo=0.5)
    model = node_model(name, {"a": a, "b": b}, opset=6, broadcast=1, axis=1)
    got = run_jax(model, {"a": a, "b": b})["y"]
    fn = {
        "Add": np.add,
        "Sub": np.subtract,
        "Mul": np.multiply,
        "Div": np.divide,
        "Pow": np.power,
        "Equal": np.equal,
        "Less": np.less,
        "Greater": np.greater,
    }[name]
    np.testing.assert_allclose(got, fn(a, b[:, None]), rtol=1e-5)


@pytest.mark.parametrize("opset", [10, 13])
def test_mod(opset):
    a, b = ints(3, 4, lo=-20, hi=20), nonzero(4)
    check_op("Mod", {"a": a, "b": b}, opset=opset)
    check_op("Mod", {"a": a, "b": b}, opset=opset, fmod=1)
    check_op("Mod", {"a": a, "b": b}, opset=opset, constants=("a", "b"))
    check_op("Mod", {"a": floats(3, 4, lo=-9, hi=9), "b": floats(4, lo=1)}, opset=opset, fmod=1)


@pytest.mark.parametrize("opset", [7, 12, 13, 15])
def test_pow(opset):
    check_op("Pow", {"x": floats(3, 4, lo=0.1), "e": floats(4)}, opset=opset)
    if opset >= 12:
        check_op("Pow", {"x": floats(3, 4), "e": ints(4, lo=0, hi=4)}, opset=opset)
        check_op("Pow", {"x": ints(3, 4), "e": ints(4, lo=0, hi=4)}, opset=opset)
        check_op("Pow", {"x": ints(3, 4, lo=1), "e": floats(1, lo=0, hi=2)}, opset=opset)


UNARY = [
    # name, since, (low, high)
    ("Neg", 13, (-3, 3)),
    ("Abs", 13, (-3, 3)),
    ("Reciprocal", 13, (0.5, 3)),
    ("Sqrt", 13, (0, 9)),
    ("Exp", 13, (-3, 3)),
    ("Log", 13, (0.1, 9)),
    ("Floor", 13, (-3, 3)),
    ("Ceil", 13, (-3, 3)),
    ("Sign", 13, (-3, 3)),
    ("Erf", 13, (-3, 3)),
    ("Tanh", 13, (-3, 3)),
    ("Sigmoid", 13, (-9, 9)),
    ("Relu", 14, (-3, 3)),
    ("Softplus", 22, (-9, 9)),
    ("Softsign", 22, (-3, 3)),
    ("Mish", 22, (-5, 5)),
    ("HardSwish", 22, (-5, 5)),
    ("Sin", 22, (-3, 3)),
    ("Cos", 22, (-3, 3)),
    ("Tan", 22, (-1.5, 1.5)),
    ("Asin", 22, (-1, 1)),
    ("Acos", 22, (-1, 1)),
    ("Atan", 22, (-3, 3)),
    ("Sinh", 22, (-3, 3)),
    ("Cosh", 22, (-3, 3)),
    ("Asinh", 22, (-3, 3)),
    ("Acosh", 22, (1, 5)),
    ("Atanh", 22, (-0.99, 0.99)),
]


@pytest.mark.parametrize("name,since,bounds", UNARY, ids=[u[0] for u in UNARY])
def test_unary_float(name, since, bounds):
    x = floats(2, 3, 4, lo=bounds[0], hi=bounds[1])
    check_op(name, {"x": x}, opset=since, rtol=1e-5, atol=1e-5)
    check_op(name, {"x": x}, opset=since, constants=("x",), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Neg", "Abs", "Sign", "Relu"])
def test_unary_int(name):
    dtype = np.int32 if name == "Relu" else np.int64
    check_op(name, {"x": ints(3, 4, dtype=dtype)})
    check_op(name, {"x": ints(3, 4, dtype=dtype)}, constants=("x",))


@pytest.mark.parametrize("opset", [11, 22])
def test_round_halves_to_even(opset):
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4, -2.6], np.float32)
    check_op("Round", {"x": x}, opset=opset)


ACTIVATIONS = [
    ("LeakyRelu", 16, {}),
    ("LeakyRelu", 6, {"alpha": 0.3}),
    ("Elu", 6, {}),
    ("Elu", 22, {"alpha": 0.5}),
    ("Selu", 6, {}),
    ("Selu", 22, {"alpha": 2.0, "gamma": 3.0}),
    ("Celu", 12, {}),
    ("Celu", 12, {"alpha": 2.0}),
    ("ThresholdedRelu", 10, {}),
    ("ThresholdedRelu", 22, {"alpha": 0.5}),
    ("HardSigmoid", 6, {}),
    ("HardSigmoid", 22, {"alpha": 0.5, "beta": 0.6}),
    ("Shrink", 9, {}),
    ("Shrink", 9, {"lambd": 1.0, "bias": 0.5}),
    ("Gelu", 20, {}),
    ("Gelu", 20, {"approximate": "tanh"}),
]


@pytest.mark.parametrize(
    "name,opset,attrs", ACTIVATIONS, ids=[f"{a[0]}-{a[1]}-{len(a[2])}" for a in ACTIVATIONS]
)
def test_activation(name, opset, attrs):
    check_op(name, {"x": floats(3, 4, 5, lo=-4, hi=4)}, opset=opset, **attrs)


def test_shrink_int():
    check_op("Shrink", {"x": ints(3, 4, dtype=np.int8)}, lambd=1.5, bias=1.0)


@pytest.mark.parametrize("opset", [9, 16])
def test_prelu(opset):
    check_op("PRelu", {"x": floats(2, 3, 4), "slope": floats(4)}, opset=opset)
    check_op("PRelu", {"x": floats(2, 3, 4), "slope": floats(3, 1)}, opset=opset)
    check_op("PRelu", {"x": floats(2, 3, 4), "slope": floats(2, 3, 4)}, opset=opset)


def test_swish():
    # Swish is opset 24; compare with its definition.
    x = floats(3, 4)
    for alpha in (1.0, 0.5):
        model = node_model("Swish", {"x": x}, opset=24, alpha=alpha)
        want = x / (1 + np.exp(-alpha * x))
        np.testing.assert_allclose(run_jax(model, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)


# Tests, comparisons and logic


@pytest.mark.parametrize("opset", [9, 13, 20])
def test_isnan(opset):
    x = np.array([1.0, np.nan, -np.inf, np.inf, 0.0], np.float32)
    check_op("IsNaN", {"x": x}, opset=opset)


@pytest.mark.parametrize("opset", [10, 20])
@pytest.mark.parametrize("detect", [(1, 1), (1, 0), (0, 1)])
def test_isinf(opset, detect):
    x = np.array([1.0, np.nan, -np.inf, np.inf, 0.0], np.float32)
    check_op("IsInf", {"x": x}, opset=opset, detect_negative=detect[0], detect_positive=detect[1])


COMPARISONS = [
    ("Equal", [7, 11, 13, 19]),
    ("Less", [7, 9, 13]),
    ("Greater", [7, 9, 13]),
    ("LessOrEqual", [12, 16]),
    ("GreaterOrEqual", [12, 16]),
]


@pytest.mark.parametrize(
    "name,opset", [(n, o) for n, opsets in COMPARISONS for o in opsets], ids=str
)
def test_comparison(name, opset):
    if name != "Equal" or opset >= 11:  # Equal-7 has no float kernel
        check_op(name, {"a": np.round(floats(3, 4)), "b": np.round(floats(4))}, opset=opset)
    if opset >= 9 or name == "Equal":
        check_op(name, {"a": ints(3, 4, lo=-2, hi=2), "b": ints(3, 1, lo=-2, hi=2)}, opset=opset)
        inputs = {"a": ints(3, 4, lo=-2, hi=2), "b": ints(4, lo=-2, hi=2)}
        check_op(name, inputs, opset=opset, constants=("a", "b"))


def test_equal_bool():
    check_op("Equal", {"a": rng.random((3, 4)) < 0.5, "b": rng.random(4) < 0.5})


@pytest.mark.parametrize("name", ["And", "Or", "Xor"])
def test_logic(name):
    a, b = rng.random((2, 3, 4)) < 0.5, rng.random((3, 1)) < 0.5
    check_op(name, {"a": a, "b": b})
    check_op(name, {"a": a, "b": b}, constants=("a", "b"))


def test_not():
    check_op("Not", {"x": rng.random((3, 4)) < 0.5})


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.uint8, np.uint32])
def test_bitshift(direction, dtype):
    x = ints(3, 4, lo=0, hi=200, dtype=dtype)
    check_op("BitShift", {"x": x, "s": ints(4, lo=0, hi=4, dtype=dtype)}, direction=direction)


@pytest.mark.parametrize("name", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64])
def test_bitwise(name, dtype):
    lo = 0 if dtype == np.uint8 else -100
    check_op(
        name, {"a": ints(3, 4, lo=lo, hi=100, dtype=dtype), "b": ints(4, lo=0, hi=100, dtype=dtype)}
    )


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64])
def test_bitwise_not(dtype):
    check_op("BitwiseNot", {"x": ints(3, 4, lo=0, hi=100, dtype=dtype)})


@pytest.mark.parametrize("opset", [9, 16])
def test_where(opset):
    cond = rng.random((3, 1)) < 0.5
    check_op("Where", {"c": cond, "x": floats(3, 4), "z": floats(4)}, opset=opset)
    check_op("Where", {"c": cond, "x": ints(1, 4), "z": ints(3, 4)}, opset=opset)
    check_op(
        "Where", {"c": cond, "x": ints(1, 4), "z": ints(3, 4)}, opset=opset, constants=("c", "x")
    )


# Variadic


@pytest.mark.parametrize("opset", [8, 12, 13])
@pytest.mark.parametrize("name", ["Max", "Min", "Sum", "Mean"])
def test_variadic(name, opset):
    check_op(name, {"a": floats(3, 4)}, opset=opset)
    check_op(name, {"a": floats(3, 4), "b": floats(4)}, opset=opset)
    check_op(name, {"a": floats(3, 1), "b": floats(4), "c": floats(2, 1, 1)}, opset=opset)


@pytest.mark.parametrize("name", ["Max", "Min"])
def test_max_min_int_and_nan(name):
    check_op(name, {"a": ints(3, 4), "b": ints(4), "c": ints(3, 1)})
    check_op(name, {"a": ints(3, 4), "b": ints(4)}, constants=("a", "b"))
    a = np.array([1.0, np.nan, 3.0], np.float32)
    check_op(name, {"a": a, "b": np.array([np.nan, 2.0, 1.0], np.float32)})


@pytest.mark.parametrize("opset", [6, 11, 12, 13])
def test_clip(opset):
    x = floats(3, 4, lo=-5, hi=5)
    if opset == 6:
        check_op("Clip", {"x": x}, opset=opset, min=-1.0, max=2.0)
        check_op("Clip", {"x": x}, opset=opset, min=-1.0)
        check_op("Clip", {"x": x}, opset=opset)
        return
    lo, hi = np.array(-1.0, np.float32), np.array(2.0, np.float32)
    check_op("Clip", {"x": x, "min": lo, "max": hi}, opset=opset)
    check_op("Clip", {"x": x, "min": lo, "max": hi}, opset=opset, constants=("min", "max"))
    check_op("Clip", {"x": x, "min": None, "max": hi}, opset=opset)
    check_op("Clip", {"x": x, "min": lo}, opset=opset)
    check_op("Clip", {"x": x}, opset=opset)
    check_op("Clip", {"x": x, "min": hi, "max": lo}, opset=opset)  # min > max: all max
    if opset >= 12:
        inputs = {"x": ints(3, 4), "min": np.array(-2, np.int64), "max": np.array(3, np.int64)}
        check_op("Clip", inputs, opset=opset)
        check_op("Clip", inputs, opset=opset, constants=("x", "min", "max"))


# Casts and Identity

CASTS = [
    (np.float32, TensorProto.INT64),
    (np.float32, TensorProto.INT32),
    (np.float32, TensorProto.INT8),
    (np.float32, TensorProto.BOOL),
    (np.float32, TensorProto.FLOAT16),
    (np.float32, TensorProto.DOUBLE),
    (np.int64, TensorProto.FLOAT),
    (np.int64, TensorProto.INT32),
    (np.int32, TensorProto.INT64),
    (np.bool_, TensorProto.FLOAT),
    (np.bool_, TensorProto.INT64),
    (np.float16, TensorProto.FLOAT),
]


def _values(dtype):
    if dtype == np.bool_:
        return rng.random((3, 4)) < 0.5
    if np.issubdtype(dtype, np.integer):
        return ints(3, 4, lo=-100, hi=100, dtype=dtype)
    return floats(3, 4, lo=-100, hi=100).astype(dtype)


@pytest.mark.parametrize("opset", [9, 13, 19, 21])
@pytest.mark.parametrize("src,to", CASTS, ids=lambda v: str(v))
def test_cast(src, to, opset):
    x = _values(src)
    check_op("Cast", {"x": x}, opset=opset, to=to)
    check_op("Cast", {"x": x}, opset=opset, to=to, constants=("x",))


@pytest.mark.parametrize("opset", [15, 19, 21])
@pytest.mark.parametrize(
    "src,dst",
    [
        (np.float32, np.int64),
        (np.int64, np.float32),
        (np.float32, np.float16),
        (np.bool_, np.int32),
    ],
)
def test_castlike(src, dst, opset):
    check_op("CastLike", {"x": _values(src), "like": _values(dst)}, opset=opset)
    check_op("CastLike", {"x": _values(src), "like": _values(dst)}, opset=opset, constants=("x",))


@pytest.mark.parametrize(
    "to,dtype",
    [
        (TensorProto.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn),
        (TensorProto.FLOAT8E5M2, ml_dtypes.float8_e5m2),
        (TensorProto.FLOAT8E4M3FNUZ, ml_dtypes.float8_e4m3fnuz),
        (TensorProto.FLOAT8E5M2FNUZ, ml_dtypes.float8_e5m2fnuz),
    ],
)
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_float8(to, dtype, saturate):
    # onnxruntime's Python API does not return float8 arrays: compare with ml_dtypes.
    x = np.array([0.3, -1.7, 2.0, 1e5, -1e5, 448.0], np.float32)
    model = node_model("Cast", {"x": x}, opset=21, to=to, saturate=saturate)
    got = run_jax(model, {"x": x})["y"]
    info = ml_dtypes.finfo(dtype)
    want = (np.clip(x, float(info.min), float(info.max)) if saturate else x).astype(dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_cast_int4_wraps():
    x = np.array([-9.0, -8.0, 7.0, 8.0, 2.7, -2.7], np.float32)
    model = node_model("Cast", {"x": x}, opset=21, to=TensorProto.INT4)
    got = run_jax(model, {"x": x})["y"]
    np.testing.assert_array_equal(got.astype(np.int8), [7, -8, 7, -8, 2, -2])


@pytest.mark.parametrize("opset", [1, 13, 16, 21])
def test_identity(opset):
    check_op("Identity", {"x": floats(3, 4)}, opset=opset)
    check_op("Identity", {"x": ints(3, 4)}, opset=opset, constants=("x",))


def test_opset1_attributes():
    # onnxruntime has no opset 1 kernels: compare with numpy.
    x = floats(3, 4)
    model = node_model("Cast", {"x": x}, opset=1, to="INT32")
    np.testing.assert_array_equal(run_jax(model, {"x": x})["y"], x.astype(np.int32))
    model = node_model("Relu", {"x": x}, opset=1, consumed_inputs=[0])
    np.testing.assert_array_equal(run_jax(model, {"x": x})["y"], np.maximum(x, 0))
    model = node_model("Clip", {"x": x}, opset=1, min=-1.0, consumed_inputs=[0])
    np.testing.assert_array_equal(run_jax(model, {"x": x})["y"], np.maximum(x, -1))


def test_int64_sentinels_do_not_wrap():
    # A known INT64_MAX/INT64_MIN meets int32 device values: clamped, not wrapped to -1/0.
    big = np.array([np.iinfo(np.int64).max], np.int64)
    small = np.array([np.iinfo(np.int64).min], np.int64)
    x = ints(3, 4)
    check_op("Min", {"x": x, "b": big}, constants=("b",))
    check_op("Max", {"x": x, "b": small}, constants=("b",))
    check_op("Clip", {"x": x, "lo": small[0], "hi": big[0]}, constants=("lo", "hi"))
    check_op("Less", {"x": x, "b": big}, constants=("b",))
    check_op("GreaterOrEqual", {"x": x, "b": small}, constants=("b",))
