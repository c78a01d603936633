"""Whether an op computes with numpy (folded at trace time) or with jax.numpy (in the program)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import jax.numpy as jnp
import numpy as np

_IN_PROGRAM = contextvars.ContextVar("in_program", default=False)


@contextlib.contextmanager
def in_program() -> Iterator[None]:
    """Within this block :func:`xp` is jax.numpy even for values known at trace time."""
    token = _IN_PROGRAM.set(True)
    try:
        yield
    finally:
        _IN_PROGRAM.reset(token)


def xp(*values: Any) -> ModuleType:
    """numpy when every value is known at trace time (numpy or None), else jax.numpy.

    Ops written against ``xp(...)`` fold shape arithmetic exactly (int64 included) with numpy and
    trace everything else with JAX.
    """
    if _IN_PROGRAM.get():
        return jnp
    if all(v is None or isinstance(v, (np.ndarray, np.generic, int, float, bool)) for v in values):
        return np
    return jnp
