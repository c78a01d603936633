"""indexing ops."""

from __future__ import annotations

from ..registry import op
from ._util import xp


@op("Gather")
def Gather(data, indices, *, axis=0):
    m = xp(data, indices)
    indices = m.where(indices < 0, indices + data.shape[axis], indices)
    return m.take(data, indices, axis=axis)
