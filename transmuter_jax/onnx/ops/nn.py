"""Neural-network ops: matrix products, convolution, pooling, normalization, softmax."""

from __future__ import annotations

from ..registry import op
from ._util import xp


@op("MatMul")
def MatMul(a, b):
    return xp(a, b).matmul(a, b)
