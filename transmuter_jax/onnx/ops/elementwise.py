"""Elementwise ops: arithmetic, comparison, logic, math functions, activations and casts."""

from __future__ import annotations

import numpy as np

from ..registry import op
from ._util import onnx_dtype, xp


@op("Identity")
def Identity(x):
    return x


@op("Add")
def Add(a, b):
    return a + b


@op("Sub")
def Sub(a, b):
    return a - b


@op("Mul")
def Mul(a, b):
    return a * b


@op("Div")
def Div(a, b):
    m = xp(a, b)
    if np.issubdtype(m.result_type(a, b), np.integer):
        return m.trunc(m.true_divide(a, b)).astype(m.result_type(a, b))
    return a / b


@op("Cast")
def Cast(x, *, to, saturate=1, round_mode="up"):
    m = xp(x)
    return m.asarray(x).astype(onnx_dtype(to, m))
