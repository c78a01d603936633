"""Whether a decoder's attention changes when its past holds hidden rows after the valid ones.

A decoder that takes position_ids can run on a buffer longer than its valid cache: the rows past
each row's length are free, hidden by zeros in attention_mask, and the graph's present is the
buffer plus the new rows ("append" cache mode). That is right only if hiding is all the free rows
do. A graph that compares key indices with positions it reads from the past's length (a sliding
window, ``key > query - window``, with the query at the buffer's end) puts the valid rows outside
its window once the buffer is longer than the window, and gives other tokens.

:func:`hidden_rows_matter` traces the graph abstractly twice, for one new token after 3 valid
rows: with no free rows, then with many, the attention mask and positions known at trace time.
The masks that reach each Softmax over the keys are then known too; they must agree on the
valid rows and the new one.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from onnx import NodeProto

from .model import Model
from .rewrite import Run, probe
from .trace import is_static

VALID = 3  # valid cached rows of the probe
FREE = (32768, 2048, 128)  # free rows tried, largest first, until the graph traces
# Ops between the scores and a Softmax that combine them with a mask (or scale them).
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> reason
_COMBINE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Where",
    "Tanh",
    "Cast",
    "Identity",
    "Max",
    "Min",
    "Reshape",
    "Expand",
}


def hidden_rows_matter(model: Model) -> str:
    """Why hidden rows after the valid ones would change the attention of ``model``.

    Args:
        model: a decoder with attention_mask, position_ids and a past (inputs of rank 4 whose
            name starts with "past"; axis 2 the past's length, heads and head size fixed).

    Returns:
        "" when the masks over the valid rows and the new token do not change with hidden rows
        (or when this cannot tell: no mask known at trace time, or a graph the probe cannot
        follow), else the reason, naming the Softmax whose mask changes. Kept per model.
    """
    if model not in _FOUND:
        _FOUND[model] = _reason(model)
    return _FOUND[model]


def _reason(model: Model) -> str:
    names = {i.name for i in model.inputs}
    past = [i for i in model.inputs if _is_past(i)]
    if not past or "attention_mask" not in names:
        return ""
    try:
        first = probe(model, _inputs(model, 0))
    except Exception:  # noqa: BLE001 - a graph the probe cannot follow: cannot tell
        return ""
    for free in FREE:
        try:
            second = probe(model, _inputs(model, free))
        except Exception:  # noqa: BLE001 - too long for this graph: try fewer rows
            continue
        return _compare(first, second, free)
    return ""


def _is_past(info) -> bool:
    shape = info.shape or ()
    lowered = info.name.lower()
    return (
        lowered.startswith("past")
        and len(shape) == 4
        and "encoder" not in lowered
        and "cross" not in lowered
    )


def _inputs(model: Model, free: int) -> dict[str, Any]:
    """One new token after VALID valid rows and ``free`` hidden ones, batch 1."""
    rows = VALID + free
    inputs: dict[str, Any] = {}
    for info in model.inputs:
        shape = tuple(info.shape or ())
        dtype = np.dtype(info.dtype)
        if _is_past(info):
            if not all(isinstance(d, int) for d in (shape[1], shape[3])):
                raise ValueError(f"the heads or head size of {info.name!r} are not fixed")
            inputs[info.name] = jax.ShapeDtypeStruct((1, shape[1], rows, shape[3]), dtype)
        elif info.name == "attention_mask":
            mask = np.zeros((1, rows + 1), dtype)
            mask[0, :VALID] = mask[0, -1] = 1
            inputs[info.name] = mask
        elif info.name == "position_ids":
            inputs[info.name] = np.full((3, 1, 1) if len(shape) == 3 else (1, 1), VALID, dtype)
        elif info.name in model.static_inputs:
            inputs[info.name] = np.ones(shape, dtype)
        elif info.name == "input_ids":
            inputs[info.name] = jax.ShapeDtypeStruct((1, 1), dtype)
        elif info.name == "inputs_embeds" and isinstance(shape[-1], int):
            inputs[info.name] = jax.ShapeDtypeStruct((1, 1, shape[-1]), dtype)
        else:
            raise ValueError(f"cannot tell the shape of input {info.name!r}")
    return inputs


def _compare(first: Run, second: Run, free: int) -> str:
    """The first Softmax whose known masks differ on the valid rows and the new token."""
    producers = _producers(first.nodes)
    keep = np.r_[0:VALID, VALID + free]  # the columns of the valid rows and the new token
    for _, _, node in first.nodes:
        if node.op_type != "Softmax":
            continue
        for name in _masks(node, producers, first, VALID + 1):
            a, b = first.values[name], second.values.get(name)
            if b is None or not is_static(b) or b.shape[-1] != VALID + free + 1:
                continue
            b = b[..., keep]
            if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
                return (
                    f"Softmax {node.name or '<unnamed>'!r} attends to other rows when the past "
                    f"holds {free} hidden rows after the valid ones (its mask {name!r} reads "
                    "the past's length, as a sliding window does)"
                )
    return ""


def _producers(nodes: Sequence[tuple[tuple, int, NodeProto]]) -> dict[str, NodeProto]:
    return {out: node for path, _, node in nodes if not path for out in node.output if out}


def _masks(softmax: NodeProto, producers: dict[str, NodeProto], run: Run, keys: int) -> list[str]:
    """The values known at trace time over ``keys`` keys that the combining ops before
    ``softmax`` add to (or select from) its scores."""
    found, seen = [], set()
    todo = [softmax.input[0]]
    while todo:
        name = todo.pop()
        node = producers.get(name)
        if name in seen or node is None or node.op_type not in _COMBINE:
            continue
        seen.add(name)
        for source in node.input:
            value = run.values.get(source)
            if value is None:
                continue
            if is_static(value):
                if value.ndim and value.shape[-1] == keys:
                    found.append(source)
            else:
                todo.append(source)
    return found
