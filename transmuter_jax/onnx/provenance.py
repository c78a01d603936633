"""How a traced value was made, for the attention products that can read its parts instead.

- Exports of grouped-query attention (optimum's ``repeat_kv``) repeat each key and value head
  for its group of query heads as ``Reshape(Expand(Unsqueeze(x, 2)), [B, Nk * g, T, H])``;
  Unsqueeze, Expand and Reshape record it, and a product over the repeated value
  (:func:`repeated`) reads ``x`` once per group.
- Attention splits a projection [B, T, N * H] into heads as ``Reshape(y, [B, T, N, H])`` and
  then ``Transpose(0, 2, 1, 3)``; Reshape records the split (:func:`split`), and the transpose of
  a split runs as one copy that every reader shares (ops._util.transposed).
- A step's keys and values join the cache's as ``Concat([cache, step], axis=2)`` (the present);
  Concat records it, and a product over the joined value (:func:`joined`) reads both parts
  where they are.

XLA:CPU writes such values out in full before a custom call reads them (the whole cache, every
layer and step). Records live while the outermost :func:`scope` (one graph's run) lasts.

- What every layer derives alike from one input (a grouped-query attention's rows from
  ``seqlens_k``) is computed once a run (:func:`derived`): XLA keeps each layer's copy.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

# Each thread's records: id(value) -> (value, x, groups, stage), the value kept so that its id
# is not reused while the record lives; and how deep its scopes are.
_local = threading.local()


def _seen() -> dict[int, tuple[Any, Any, int, str]]:
    if not hasattr(_local, "seen"):
        _local.seen, _local.depth = {}, 0
    return _local.seen


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Records made within it (in this thread) are dropped when the outermost scope ends; what
    :func:`derived` keeps, when this scope ends (a subgraph's run is traced apart)."""
    _seen()
    _local.depth += 1
    kept = getattr(_local, "derived", None)
    _local.derived = {}
    try:
        yield
    finally:
        _local.derived = kept
        _local.depth -= 1
        if _local.depth == 0:
            _local.seen.clear()


def _traced(value: Any) -> bool:
    return getattr(_local, "depth", 0) > 0 and isinstance(value, jax.Array | jax.core.Tracer)


def _get(value: Any, stage: str) -> tuple[Any, int] | None:
    entry = _seen().get(id(value))
    if entry is None or entry[0] is not value or entry[3] != stage:
        return None
    return entry[1], entry[2]


def unsqueezed(out: Any, x: Any, axes: list[int]) -> None:
    """Records ``out = Unsqueeze(x, axes)`` where it inserts axis 2 of a rank-4 ``x``."""
    if _traced(out) and np.ndim(x) == 4 and list(axes) == [2]:
        _seen()[id(out)] = (out, x, 1, "unsqueezed")


def expanded(out: Any, value: Any) -> None:
    """Records ``out = Expand(value)`` where it repeats the axis an Unsqueeze inserted."""
    found = _get(value, "unsqueezed") if _traced(out) else None
    if found is not None:
        x = found[0]
        shape = np.shape(x)
        if np.ndim(out) == 5 and np.shape(out)[:2] + np.shape(out)[3:] == shape[:2] + shape[2:]:
            _seen()[id(out)] = (out, x, int(np.shape(out)[2]), "expanded")


def reshaped(out: Any, value: Any) -> None:
    """Records ``out = Reshape(value)`` where it merges the repeated axis into the heads, or where
    it splits the last axis of a rank-3 value in two (heads)."""
    if _traced(out) and np.ndim(value) == 3 and np.ndim(out) == 4:
        if np.shape(out)[:2] == np.shape(value)[:2]:
            _seen()[id(out)] = (out, value, 0, "split")
            return
    found = _get(value, "expanded") if _traced(out) else None
    if found is not None:
        x, groups = found
        b, heads, t, h = np.shape(x)
        if np.shape(out) == (b, heads * groups, t, h):
            _seen()[id(out)] = (out, x, groups, "repeated")


def repeated(value: Any) -> tuple[Any, int] | None:
    """(x, groups) where ``value`` is x [B, Nk, T, H] with each head repeated ``groups`` times
    (head n of ``value`` is head n // groups of x), else None."""
    return _get(value, "repeated")


def split(value: Any) -> bool:
    """Whether ``value`` [B, T, N, H] is a rank-3 value's last axis split in two (heads)."""
    return _get(value, "split") is not None


def concatenated(out: Any, parts: tuple, axis: int) -> None:
    """Records ``out = Concat(parts, axis)`` where it joins two rank-4 values along axis 2."""
    if _traced(out) and len(parts) == 2 and np.ndim(out) == 4 and axis % 4 == 2:
        if all(np.ndim(p) == 4 and not isinstance(p, np.ndarray) for p in parts):
            _seen()[id(out)] = (out, tuple(parts), 0, "joined")


def joined(value: Any) -> tuple[Any, Any] | None:
    """(first, second) where ``value`` is their concatenation along axis 2, else None."""
    found = _get(value, "joined")
    return None if found is None else found[0]


def derived(value: Any, name: str, make: Callable[[], Any]) -> Any:
    """``make()``, made once for ``value`` (by identity) and ``name`` in the innermost
    :func:`scope` (one graph's run; outside one, every call makes it)."""
    kept = getattr(_local, "derived", None)
    if kept is None or not _traced(value):
        return make()
    entry = kept.get((id(value), name))
    if entry is not None and entry[0] is value:
        return entry[1]
    result = make()
    kept[(id(value), name)] = (value, result)
    return result
