"""Elementwise ops: arithmetic, comparison, logic, math functions, activations and casts.

Opset 1-6 attributes are accepted: ``consumed_inputs`` (ignored) and the legacy broadcasting
``broadcast``/``axis`` of binary ops (``b`` aligned with ``a`` from dimension ``axis``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from onnx import TensorProto

from ..dtypes import device_dtype
from ..registry import op
from ._util import onnx_dtype, xp

_FLOAT8 = {
    np.dtype(ml_dtypes.float8_e4m3fn),
    np.dtype(ml_dtypes.float8_e4m3fnuz),
    np.dtype(ml_dtypes.float8_e5m2),
    np.dtype(ml_dtypes.float8_e5m2fnuz),
}
_SUBBYTE_INT = {
    np.dtype(t) for t in (ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.int2, ml_dtypes.uint2)
}


def _legacy(a, b, axis):
    """``b`` reshaped to broadcast against ``a`` from dimension ``axis`` (opset < 7)."""
    if axis is None:
        return b
    axis = axis + np.ndim(a) if axis < 0 else axis
    return b.reshape(tuple(np.shape(b)) + (1,) * (np.ndim(a) - axis - np.ndim(b)))


def _clamped(m, *values):
    """``values`` with known int64 arrays clamped into the device's int32 range when ``m`` is
    jax.numpy, so a sentinel like INT64_MAX stays the largest value instead of wrapping around.
    For ops whose result is one of their inputs or a comparison (Max, Min, Clip, Less, ...)."""
    if m is np:
        return values
    out = []
    for v in values:
        if isinstance(v, np.ndarray) and v.dtype.kind in "iu" and device_dtype(v.dtype) != v.dtype:
            info = np.iinfo(device_dtype(v.dtype))
            v = np.clip(v, info.min, info.max)
        out.append(v)
    return out


def _is_int(m, *values) -> bool:
    return np.issubdtype(m.result_type(*values), np.integer)


# Arithmetic


@op("Identity")
def Identity(x):
    return x


@op("Add")
def Add(a, b, *, broadcast=0, axis=None, consumed_inputs=None):
    return xp(a, b).add(a, _legacy(a, b, axis))


@op("Sub")
def Sub(a, b, *, broadcast=0, axis=None, consumed_inputs=None):
    return xp(a, b).subtract(a, _legacy(a, b, axis))


@op("Mul")
def Mul(a, b, *, broadcast=0, axis=None, consumed_inputs=None):
    return xp(a, b).multiply(a, _legacy(a, b, axis))


@op("Div")
def Div(a, b, *, broadcast=0, axis=None, consumed_inputs=None):
    """Integer division truncates toward zero (like C), float division is IEEE."""
    m, b = xp(a, b), _legacy(a, b, axis)
    if _is_int(m, a, b):
        q = m.floor_divide(a, b)
        return q + ((m.remainder(a, b) != 0) & ((a < 0) != (b < 0))).astype(q.dtype)
    return m.true_divide(a, b)


@op("Mod", since=10)
def Mod(a, b, *, fmod=0):
    """fmod=0: the remainder has the divisor's sign (Python); fmod=1: the dividend's (C)."""
    m = xp(a, b)
    return m.fmod(a, b) if fmod else m.remainder(a, b)


@op("Pow")
def Pow(x, y, *, broadcast=0, axis=None):
    """The result has the base's dtype."""
    m = xp(x, y)
    x = m.asarray(x)
    return m.power(x, _legacy(x, y, axis)).astype(x.dtype)


@op("Neg")
def Neg(x, *, consumed_inputs=None):
    return xp(x).negative(x)


@op("Abs")
def Abs(x, *, consumed_inputs=None):
    return xp(x).abs(x)


@op("Reciprocal")
def Reciprocal(x, *, consumed_inputs=None):
    return xp(x).reciprocal(x)


@op("Sqrt")
def Sqrt(x, *, consumed_inputs=None):
    return xp(x).sqrt(x)


@op("Exp")
def Exp(x, *, consumed_inputs=None):
    return xp(x).exp(x)


@op("Log")
def Log(x, *, consumed_inputs=None):
    return xp(x).log(x)


@op("Floor")
def Floor(x, *, consumed_inputs=None):
    return xp(x).floor(x)


@op("Ceil")
def Ceil(x, *, consumed_inputs=None):
    return xp(x).ceil(x)


@op("Round", since=11)
def Round(x):
    """Halves round to even."""
    return xp(x).round(x)


@op("Sign", since=9)
def Sign(x):
    return xp(x).sign(x)


@op("Erf", since=9)
def Erf(x):
    return jax.scipy.special.erf(x)


@op("Max")
def Max(*inputs, consumed_inputs=None):
    """Variadic, broadcasting; NaN propagates."""
    m = xp(*inputs)
    return functools.reduce(m.maximum, _clamped(m, *inputs))


@op("Min")
def Min(*inputs, consumed_inputs=None):
    """Variadic, broadcasting; NaN propagates."""
    m = xp(*inputs)
    return functools.reduce(m.minimum, _clamped(m, *inputs))


@op("Sum")
def Sum(*inputs, consumed_inputs=None):
    return functools.reduce(xp(*inputs).add, inputs)


@op("Mean")
def Mean(*inputs, consumed_inputs=None):
    m = xp(*inputs)
    return (functools.reduce(m.add, inputs) / len(inputs)).astype(m.result_type(*inputs))


@op("Clip")
def Clip(x, min=None, max=None, *, consumed_inputs=None):
    """``min(max(x, min), max)``: ``max`` wins where ``min > max``. Attributes up to opset 6."""
    m = xp(x, min, max)
    x, min, max = m.asarray(x), *_clamped(m, min, max)
    if min is not None:
        x = m.maximum(x, m.asarray(min).astype(x.dtype))
    if max is not None:
        x = m.minimum(x, m.asarray(max).astype(x.dtype))
    return x


# Activations


@op("Tanh")
def Tanh(x, *, consumed_inputs=None):
    return xp(x).tanh(x)


@op("Sigmoid")
def Sigmoid(x, *, consumed_inputs=None):
    return jax.nn.sigmoid(x)


@op("HardSigmoid")
def HardSigmoid(x, *, alpha=0.2, beta=0.5, consumed_inputs=None):
    return jnp.clip(alpha * x + beta, 0, 1).astype(x.dtype)


@op("HardSwish", since=14)
def HardSwish(x):
    return (x * jnp.clip(x / 6 + 0.5, 0, 1)).astype(x.dtype)


@op("Relu")
def Relu(x, *, consumed_inputs=None):
    m = xp(x)
    return m.maximum(x, m.zeros((), x.dtype))


@op("LeakyRelu")
def LeakyRelu(x, *, alpha=0.01, consumed_inputs=None):
    return jnp.where(x < 0, alpha * x, x).astype(x.dtype)


@op("PRelu")
def PRelu(x, slope, *, consumed_inputs=None):
    """``slope`` broadcasts to ``x``."""
    return jnp.where(x < 0, slope * x, x).astype(x.dtype)


@op("Elu")
def Elu(x, *, alpha=1.0, consumed_inputs=None):
    return jnp.where(x < 0, alpha * jnp.expm1(x), x).astype(x.dtype)


@op("Selu")
def Selu(x, *, alpha=1.6732632423543772, gamma=1.0507009873554805, consumed_inputs=None):
    """The defaults are opset 6's (opset 1 had 1.6732 and 1.0507)."""
    return (gamma * jnp.where(x <= 0, alpha * jnp.expm1(x), x)).astype(x.dtype)


@op("Celu", since=12)
def Celu(x, *, alpha=1.0):
    return (jnp.maximum(x, 0) + jnp.minimum(0, alpha * jnp.expm1(x / alpha))).astype(x.dtype)


@op("ThresholdedRelu", since=10)
def ThresholdedRelu(x, *, alpha=1.0):
    return jnp.where(x > alpha, x, 0).astype(x.dtype)


@op("Softplus")
def Softplus(x):
    return jax.nn.softplus(x)


@op("Softsign")
def Softsign(x):
    return x / (1 + jnp.abs(x))


@op("Mish", since=18)
def Mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@op("Gelu", since=20)
def Gelu(x, *, approximate="none"):
    """approximate="tanh" is the tanh approximation, "none" the exact erf form."""
    return jax.nn.gelu(x, approximate=approximate == "tanh")


@op("Swish", since=24)
def Swish(x, *, alpha=1.0):
    return (x * jax.nn.sigmoid(alpha * x)).astype(x.dtype)


@op("Shrink", since=9)
def Shrink(x, *, bias=0.0, lambd=0.5):
    y = jnp.where(x < -lambd, x + bias, jnp.where(x > lambd, x - bias, 0))
    return y.astype(x.dtype)


# Trigonometric and hyperbolic functions


@op("Sin", since=7)
def Sin(x):
    return xp(x).sin(x)


@op("Cos", since=7)
def Cos(x):
    return xp(x).cos(x)


@op("Tan", since=7)
def Tan(x):
    return xp(x).tan(x)


@op("Asin", since=7)
def Asin(x):
    return xp(x).arcsin(x)


@op("Acos", since=7)
def Acos(x):
    return xp(x).arccos(x)


@op("Atan", since=7)
def Atan(x):
    return xp(x).arctan(x)


@op("Sinh", since=9)
def Sinh(x):
    return xp(x).sinh(x)


@op("Cosh", since=9)
def Cosh(x):
    return xp(x).cosh(x)


@op("Asinh", since=9)
def Asinh(x):
    return xp(x).arcsinh(x)


@op("Acosh", since=9)
def Acosh(x):
    return xp(x).arccosh(x)


@op("Atanh", since=9)
def Atanh(x):
    return xp(x).arctanh(x)


# Tests, comparisons and logic


@op("IsNaN", since=9)
def IsNaN(x):
    return xp(x).isnan(x)


@op("IsInf", since=10)
def IsInf(x, *, detect_negative=1, detect_positive=1):
    return ((x == np.inf) & bool(detect_positive)) | ((x == -np.inf) & bool(detect_negative))


@op("Equal")
def Equal(a, b, *, broadcast=0, axis=None):
    m = xp(a, b)
    return m.equal(*_clamped(m, a, _legacy(a, b, axis)))


@op("Less")
def Less(a, b, *, broadcast=0, axis=None):
    m = xp(a, b)
    return m.less(*_clamped(m, a, _legacy(a, b, axis)))


@op("LessOrEqual", since=12)
def LessOrEqual(a, b):
    m = xp(a, b)
    return m.less_equal(*_clamped(m, a, b))


@op("Greater")
def Greater(a, b, *, broadcast=0, axis=None):
    m = xp(a, b)
    return m.greater(*_clamped(m, a, _legacy(a, b, axis)))


@op("GreaterOrEqual", since=12)
def GreaterOrEqual(a, b):
    m = xp(a, b)
    return m.greater_equal(*_clamped(m, a, b))


@op("Not")
def Not(x):
    return xp(x).logical_not(x)


@op("And")
def And(a, b, *, broadcast=0, axis=None):
    return xp(a, b).logical_and(a, _legacy(a, b, axis))


@op("Or")
def Or(a, b, *, broadcast=0, axis=None):
    return xp(a, b).logical_or(a, _legacy(a, b, axis))


@op("Xor")
def Xor(a, b, *, broadcast=0, axis=None):
    return xp(a, b).logical_xor(a, _legacy(a, b, axis))


@op("BitShift", since=11)
def BitShift(x, y, *, direction):
    m = xp(x, y)
    return m.left_shift(x, y) if direction == "LEFT" else m.right_shift(x, y)


@op("BitwiseAnd", since=18)
def BitwiseAnd(a, b):
    return xp(a, b).bitwise_and(a, b)


@op("BitwiseOr", since=18)
def BitwiseOr(a, b):
    return xp(a, b).bitwise_or(a, b)


@op("BitwiseXor", since=18)
def BitwiseXor(a, b):
    return xp(a, b).bitwise_xor(a, b)


@op("BitwiseNot", since=18)
def BitwiseNot(x):
    return xp(x).invert(x)


@op("Where", since=9)
def Where(condition, x, y):
    return xp(condition, x, y).where(condition, x, y)


# Casts


def _cast(x, dtype, saturate):
    """``x`` as ``dtype``. Float8 targets clamp to their finite range when ``saturate``; floats
    cast to 4- and 2-bit integers truncate then wrap around like the ONNX reference."""
    m = xp(x)
    if dtype in _FLOAT8 and saturate:
        info = ml_dtypes.finfo(dtype)
        x = m.clip(x, float(info.min), float(info.max))
    if dtype in _SUBBYTE_INT and not np.issubdtype(x.dtype, np.integer):
        x = x.astype(np.int32)
    return m.asarray(x).astype(dtype)


def _e8m0(x, saturate, round_mode):
    """x as float8e8m0 (a power of two): float32's exponent, rounded ``up`` (any fraction),
    ``down`` or to ``nearest``; NaN and infinities become NaN; saturate stops at the largest."""
    m = xp(x)
    f32 = m.asarray(x).astype(np.float32)
    bits = f32.view(np.uint32) if m is np else jax.lax.bitcast_convert_type(f32, jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32)
    special = exponent == 0xFF
    if round_mode == "up":
        bump = (bits & 0x7FFFFF) > 0
    elif round_mode == "nearest":
        guard, rest = (bits & 0x400000) > 0, (bits & 0x3FFFFF) > 0
        bump = guard & (rest | (exponent > 0))
    else:
        bump = m.zeros(exponent.shape, bool)
    bump = bump & ~special
    if saturate:
        bump = bump & (exponent != 0xFE)
    out = m.where(special, 0xFF, exponent + bump.astype(np.int32)).astype(np.uint8)
    if m is np:
        return out.view(ml_dtypes.float8_e8m0fnu)
    return jax.lax.bitcast_convert_type(out, ml_dtypes.float8_e8m0fnu)


@op("Cast")
def Cast(x, *, to, saturate=1, round_mode="up"):
    """``to`` is a type name ("FLOAT") in opset 1. ``saturate`` applies to float8 targets;
    ``round_mode`` to float8e8m0 targets."""
    to = TensorProto.DataType.Value(to.upper()) if isinstance(to, str) else to
    if to == TensorProto.FLOAT8E8M0:
        return _e8m0(x, saturate, round_mode)
    return _cast(x, onnx_dtype(to, xp(x)), saturate)


@op("CastLike", since=15)
def CastLike(x, target, *, saturate=1, round_mode="up"):
    """``x`` cast to the dtype of ``target``."""
    return _cast(x, target.dtype, saturate)


@op("BitCast", since=26)
def BitCast(x, *, to):
    """The bits of each element of x read as type ``to`` of the same width. On the device
    64-bit types are 32-bit (x64 off), so there they are refused."""
    target = onnx_dtype(to)
    if isinstance(x, np.ndarray):
        return x.view(target)
    if target.itemsize == 8 or np.dtype(x.dtype).itemsize == 8 or target != device_dtype(target):
        raise NotImplementedError(f"BitCast of traced {x.dtype} to {target}: 64-bit on device")
    if target == np.bool_ or x.dtype == np.bool_:
        return jax.lax.bitcast_convert_type(jnp.asarray(x).astype(np.uint8), np.uint8) != 0
    return jax.lax.bitcast_convert_type(x, target)


@op("SwiGLU", since=28)
def SwiGLU(a, b, *, alpha=1.0):
    """a * sigmoid(alpha * a) * b."""
    m = xp(a, b)
    return (a * (1 / (1 + m.exp(-alpha * a))).astype(a.dtype) * b).astype(a.dtype)


@op("Binarizer", domain="ai.onnx.ml")
def Binarizer(X, *, threshold=0.0):
    """1 where X > threshold, else 0, in X's dtype."""
    return (X > threshold).astype(X.dtype)
