"""Operator implementations, one module per family. Importing this package registers them."""

from . import (  # noqa: F401
    attention,
    control,
    elementwise,
    experts,
    image,
    indexing,
    nn,
    quant,
    random,
    recurrent,
    reduce,
    sequence,
    shape,
    signal,
    training,
)
from ._util import write_rows  # the ops' row writer, which the KV cache modes share

__all__ = ["write_rows"]
