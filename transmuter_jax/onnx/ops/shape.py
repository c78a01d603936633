"""Shape ops: Shape, Reshape, Concat, Unsqueeze, Squeeze, Transpose, Expand, ... ."""

from __future__ import annotations

import numpy as np

from ..registry import op
from ._util import ints, xp


@op("Shape")
def Shape(x, *, start=0, end=None):
    return np.asarray(np.shape(x)[start:end], dtype=np.int64)


@op("Reshape", static=(1,))
def Reshape(x, shape, *, allowzero=0):
    target = ints(shape)
    if not allowzero:
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return xp(x).reshape(x, target)


@op("Concat")
def Concat(*inputs, axis):
    return xp(*inputs).concatenate(inputs, axis=axis)
