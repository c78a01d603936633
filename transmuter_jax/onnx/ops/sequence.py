"""Sequence and optional ops, where a graph holds them at trace time.

A sequence is a :class:`Seq` (a tuple of tensors known while tracing: its length is static); a
graph input or output of sequence type is its elements stacked along a new axis 0, so a sequence
crossing the graph's boundary has elements of one shape. An optional is its value, or
:data:`NONE` when empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from ..registry import op
from ..trace import is_static
from ._util import ints, xp


@dataclass(frozen=True)
class Seq:
    """A sequence of tensors at trace time."""

    items: tuple

    def __jax_array__(self):
        return jnp.stack([jnp.asarray(v) for v in self.items])

    def __array__(self, dtype=None, copy=None):
        return np.stack([np.asarray(v) for v in self.items]).astype(dtype)


class _Empty:
    """The value of an empty optional."""

    def __repr__(self) -> str:
        return "NONE"


NONE = _Empty()


def items(value) -> list:
    """The elements of a sequence: a Seq, or a tensor stacked along axis 0 (a graph input)."""
    if isinstance(value, Seq):
        return list(value.items)
    if value is None or value is NONE:
        return []
    return [value[i] for i in range(value.shape[0])]


def _position(position, length, insert=False):
    if position is None:
        return length if insert else length - 1
    p = ints(position)[0]
    return p + length if p < 0 else p


@op("SequenceEmpty", since=11, fold=False)
def SequenceEmpty(*, dtype=1):
    """An empty sequence (of ``dtype`` elements)."""
    return (Seq(()),)


@op("SequenceConstruct", since=11, fold=False)
def SequenceConstruct(*inputs):
    """The sequence of the inputs."""
    return (Seq(tuple(inputs)),)


@op("SequenceInsert", since=11, static=(2,), fold=False)
def SequenceInsert(input_sequence, tensor, position=None):
    """The sequence with ``tensor`` inserted at ``position`` (default: the end)."""
    values = items(input_sequence)
    values.insert(_position(position, len(values), insert=True), tensor)
    return (Seq(tuple(values)),)


@op("SequenceErase", since=11, static=(1,), fold=False)
def SequenceErase(input_sequence, position=None):
    """The sequence without its element at ``position`` (default: the last)."""
    values = items(input_sequence)
    del values[_position(position, len(values))]
    return (Seq(tuple(values)),)


@op("SequenceAt", since=11, static=(1,), fold=False)
def SequenceAt(input_sequence, position):
    """The element at ``position``."""
    values = items(input_sequence)
    return values[_position(position, len(values))]


@op("SequenceLength", since=11, fold=False)
def SequenceLength(input_sequence):
    """The number of elements, an int64 scalar known at trace time."""
    return np.asarray(len(items(input_sequence)), np.int64)


@op("SplitToSequence", since=11, static=(1,), fold=False)
def SplitToSequence(input, split=None, *, axis=0, keepdims=1):
    """input split along ``axis`` into pieces of the sizes ``split`` (a scalar: equal pieces,
    the last shorter), or into single slices (squeezed unless ``keepdims``)."""
    m = xp(input)
    size = input.shape[axis]
    if split is None:
        pieces = [m.take(input, i, axis=axis) for i in range(size)]
        if keepdims:
            pieces = [m.expand_dims(p, axis) for p in pieces]
        return (Seq(tuple(pieces)),)
    sizes = ints(split)
    if np.ndim(split) == 0:
        sizes = [sizes[0]] * (size // sizes[0]) + ([size % sizes[0]] if size % sizes[0] else [])
    bounds = np.cumsum([0, *sizes])
    pieces = [
        m.take(input, m.arange(int(a), int(b)), axis=axis)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return (Seq(tuple(pieces)),)


@op("ConcatFromSequence", since=11, fold=False)
def ConcatFromSequence(input_sequence, *, axis, new_axis=0):
    """The elements concatenated along ``axis`` (stacked along a new one if ``new_axis``)."""
    values = items(input_sequence)
    m = np if all(is_static(v) for v in values) else jnp
    return m.stack(values, axis=axis) if new_axis else m.concatenate(values, axis=axis)


@op("SequenceMap", since=17, fold=False)
def SequenceMap(input_sequence, *additional_inputs, body, ctx):
    """``body`` applied to each element (and the matching element of each additional sequence,
    or each additional tensor whole); one output sequence per body output."""
    first = items(input_sequence)
    others = [
        items(a) if isinstance(a, Seq) or _is_graph_sequence(ctx, ctx.node.input[i + 1]) else None
        for i, a in enumerate(additional_inputs)
    ]
    outs: list[list] = [[] for _ in body.output]
    for k, value in enumerate(first):
        args = [value] + [
            o[k] if o is not None else a for o, a in zip(others, additional_inputs, strict=True)
        ]
        for acc, result in zip(outs, ctx.run(body, args), strict=True):
            acc.append(result)
    return tuple(Seq(tuple(acc)) for acc in outs)


def _is_graph_sequence(ctx, name) -> bool:
    """Whether the graph input ``name`` is of sequence type (it arrives stacked)."""
    for info in ctx.graph.proto.input:
        if info.name == name:
            return info.type.WhichOneof("value") == "sequence_type"
    return False


@op("Optional", since=15, fold=False)
def Optional(input=None, *, type=None):
    """An optional holding ``input``, or empty."""
    return (NONE,) if input is None else (input,)


@op("OptionalHasElement", since=15, fold=False)
def OptionalHasElement(input=None):
    """Whether the optional holds a value."""
    return np.asarray(input is not None and input is not NONE)


@op("OptionalGetElement", since=15, fold=False)
def OptionalGetElement(input):
    """The value of the optional (a tensor or sequence passes through)."""
    if input is NONE:
        raise ValueError("OptionalGetElement of an empty optional")
    return (input,) if isinstance(input, Seq) else input
