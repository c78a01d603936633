"""Fused q/k/v projections rewritten as one product each, so that the sharding rules split them
by heads (:mod:`transmuter_jax.parallel.sharding`).

Two layouts of the main graph are rewritten:

- a product whose output a Split cuts along its last axis, after an optional bias Add and an
  optional Reshape that keeps the last axis (GPT-2's ``c_attn`` as optimum exports it): one
  product (with its bias and Reshape) per Split output, each named as that output;
- a product packed into GroupQueryAttention (its query input, with key and value empty, as the
  genai builder writes it): three products feeding query, key and value.

MatMul, Gemm and MatMulNBits products are cut along their output features (N): the weight and
what follows its columns (a Gemm's bias, MatMulNBits' scales, zero points and bias) are sliced,
on the host. Each output column is the same dot product as before, so the values are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from onnx import GraphProto, NodeProto, helper, numpy_helper

from .model import Model
from .products import attr, linear
from .registry import DEFAULT_DOMAINS
from .trace import subgraphs

_LINEAR = ("MatMul", "Gemm", "MatMulNBits")


def split_qkv(model: Model) -> Model:
    """``model`` with its fused q/k/v projections as separate products (``model`` itself when
    it has none); the new weights are host arrays, the others are shared."""
    proto = GraphProto()
    proto.CopyFrom(model.graph.proto)
    params = dict(model.params)
    shapes = {k: tuple(np.shape(v)) for k, v in model.graph.constants.items()}
    shapes |= {k: tuple(np.shape(v)) for k, v in params.items()}
    rewriter = _Rewriter(proto, params, model.graph.constants, shapes)
    if not rewriter.run():
        return model
    return model.with_graph(proto, params=rewriter.params)


class _Rewriter:
    def __init__(self, proto: GraphProto, params: dict, constants: Mapping, shapes: dict):
        self.proto, self.params, self.constants, self.shapes = proto, params, constants, shapes
        self.producer = {o: n for n in proto.node for o in n.output if o}
        self.uses: dict[str, int] = {}
        for node in proto.node:
            for name in _reads(node):
                self.uses[name] = self.uses.get(name, 0) + 1
        self.fixed = {o.name for o in proto.output}
        self.count = 0
        self.extra: list[NodeProto] = []  # Constant nodes of sliced constants

    def run(self) -> bool:
        """Rewrites every fused projection found; whether any was."""
        plans = []
        for node in self.proto.node:
            if node.op_type == "Split":
                plan = self._split(node)
            elif node.op_type == "GroupQueryAttention":
                plan = self._packed(node)
            else:
                plan = None
            if plan is not None:
                plans.append(plan)
        if not plans:
            return False
        removed = {id(n) for plan in plans for n in plan[1]}
        before = {id(plan[0]): plan[2] for plan in plans}
        nodes = []
        for node in self.proto.node:
            nodes.extend(before.get(id(node), []))
            if id(node) not in removed:
                nodes.append(node)
        del self.proto.node[:]
        self.proto.node.extend(nodes)
        still = {name for node in nodes for name in _reads(node)}
        for plan in plans:
            for name in plan[3]:
                if name not in still:
                    self.params.pop(name, None)
        return True

    # -- the two layouts --------------------------------------------------------------------

    def _chain(self, value: str) -> tuple[NodeProto | None, NodeProto | None, NodeProto | None]:
        """The product, its bias Add and its Reshape that make ``value`` (None when it is not
        one product whose intermediate values nothing else reads)."""
        reshape = add = None
        node = self.producer.get(value)
        if node is not None and node.op_type == "Reshape" and self._only(value):
            reshape, value = node, node.input[0]
            node = self.producer.get(value)
        if node is not None and node.op_type == "Add" and self._only(value):
            bias = [i for i in node.input if len(self.shapes.get(i, ())) == 1]
            if len(bias) == 1:
                add, value = node, next(i for i in node.input if i != bias[0])
                node = self.producer.get(value)
        if node is None or node.op_type not in _LINEAR or not self._only(value):
            return None, None, None
        if node.domain not in (*DEFAULT_DOMAINS, "com.microsoft"):
            return None, None, None
        info = linear(node, self.shapes)
        if info is None:
            return None, None, None
        if info.weight not in self.params or not self._cuttable(node, info):
            return None, None, None
        return node, add, reshape

    def _cuttable(self, node: NodeProto, info) -> bool:
        """Whether every input of the product that may hold output features is one the cut
        slices: a bias (or scales) the rules do not see as an initializer, computed by a node
        or 2-D, would meet the cut columns whole, so the product stays fused (replicated)."""
        skip = {node.input[0]} | set(info.column)
        for name in node.input[1:]:
            if not name or name in skip:
                continue
            shape = self.shapes.get(name)
            if shape is None or (shape and shape[-1] == info.n and info.n > 1):
                return False
        return True

    def _split(self, split: NodeProto):
        """A Split along the last axis of one product's output: one product per output."""
        lin, add, reshape = self._chain(split.input[0])
        if lin is None:
            return None
        n = linear(lin, self.shapes).n
        outputs = list(split.output)
        sizes = self._value(split.input[1]) if len(split.input) > 1 and split.input[1] else None
        sizes = sizes if sizes is not None else attr(split, "split", None)
        if sizes is None:
            sizes = [n // len(outputs)] * len(outputs) if n % len(outputs) == 0 else None
        if sizes is None or len(sizes) != len(outputs) or sum(int(s) for s in sizes) != n:
            return None
        axis = int(attr(split, "axis", 0))
        if axis != -1:
            rank = self._length(reshape.input[1]) if reshape is not None else None
            if rank is None or axis != rank - 1:
                return None
        if reshape is not None and not self._keeps_last(reshape.input[1], n):
            return None
        shape = self._last_free(reshape) if reshape is not None else []
        nodes = list(shape)
        target = shape[-1].output[0] if shape else None
        for i, (name, size) in enumerate(zip(outputs, sizes, strict=True)):
            start = sum(int(s) for s in sizes[:i])
            nodes += self._part(lin, add, reshape, target, start, int(size), name)
        removed = [n_ for n_ in (lin, add, reshape, split) if n_ is not None]
        return split, removed, nodes, self._weights(lin, add)

    def _packed(self, gqa: NodeProto):
        """A product packed into GroupQueryAttention: three products for query, key, value."""
        ins = list(gqa.input) + [""] * 3
        if ins[1] or ins[2]:
            return None
        lin, add, reshape = self._chain(ins[0])
        if lin is None or reshape is not None:
            return None
        heads, kv = int(attr(gqa, "num_heads", 0)), int(attr(gqa, "kv_num_heads", 0))
        n = linear(lin, self.shapes).n
        if not heads or not kv or n % (heads + 2 * kv):
            return None
        size = n // (heads + 2 * kv)
        parts = [(0, heads * size), (heads * size, kv * size), ((heads + kv) * size, kv * size)]
        nodes, names = [], []
        for start, width in parts:
            names.append(self._name(ins[0]))
            nodes += self._part(lin, add, None, None, start, width, names[-1])
        gqa.input[0], gqa.input[1], gqa.input[2] = names  # in place: the node stays
        while len(gqa.input) < 3:
            gqa.input.append("")
        return gqa, [n_ for n_ in (lin, add) if n_ is not None], nodes, self._weights(lin, add)

    # -- pieces ---------------------------------------------------------------------------

    def _part(self, lin, add, reshape, shape, start: int, width: int, out: str) -> list:
        """The nodes that compute columns [start, start + width) of the chain, into ``out``."""
        info = linear(lin, self.shapes)
        node = NodeProto()
        node.CopyFrom(lin)
        node.name = f"{lin.name}.cols{start}"
        self.extra = []
        for j, name in enumerate(node.input):
            if name in info.column:
                node.input[j] = self._slice(name, info.column[name], start, width, info.n)
        if lin.op_type == "MatMulNBits":
            for a in node.attribute:
                if a.name == "N":
                    a.i = width
        value = self._name(lin.output[0])
        node.output[0] = value
        nodes = [node]
        if add is not None:
            bias = next(i for i in add.input if len(self.shapes.get(i, ())) == 1)
            piece = self._slice(bias, 0, start, width, info.n)
            other = [piece if i == bias else value for i in add.input]
            name = f"{add.name}.cols{start}"
            nodes.append(helper.make_node("Add", other, [self._name(value)], name=name))
            value = nodes[-1].output[0]
        if reshape is not None:
            allow = int(attr(reshape, "allowzero", 0))
            name = f"{reshape.name}.cols{start}"
            nodes.append(
                helper.make_node(
                    "Reshape", [value, shape], [self._name(value)], name=name, allowzero=allow
                )
            )
        nodes[-1].output[0] = out
        return self.extra + nodes

    def _slice(self, name: str, axis: int, start: int, width: int, n: int) -> str:
        """The initializer ``name`` cut to output features [start, start + width) along
        ``axis`` (a 1-D array of MatMulNBits holds a run of values per feature): a weight on
        the host, or a Constant node for a constant."""
        weight = name in self.params
        array = np.asarray(self.params[name] if weight else self.constants[name])
        per = array.shape[axis] // n if array.ndim == 1 else 1
        index = [slice(None)] * array.ndim
        index[axis] = slice(start * per, (start + width) * per)
        piece = np.ascontiguousarray(array[tuple(index)])
        new = f"{name}.cols{start}"
        self.shapes[new] = piece.shape
        if weight:
            self.params[new] = piece
        else:
            self.extra.append(_constant(new, piece))
        return new

    def _weights(self, lin, add) -> list[str]:
        names = [i for i in lin.input if i in self.params]
        if add is not None:
            names += [i for i in add.input if i in self.params]
        return names

    def _last_free(self, reshape: NodeProto) -> list[NodeProto]:
        """Nodes making ``reshape``'s shape with its last entry -1 (each part's own width)."""
        shape = reshape.input[1]
        const = self._value(shape)
        if const is not None:
            return [_constant(self._name(shape), np.array([*const[:-1], -1], np.int64))]
        starts, ends, minus, head = (self._name(shape) for _ in range(4))
        return [
            _constant(starts, np.array([0], np.int64)),
            _constant(ends, np.array([-1], np.int64)),
            _constant(minus, np.array([-1], np.int64)),
            helper.make_node("Slice", [shape, starts, ends], [head]),
            helper.make_node("Concat", [head, minus], [self._name(shape)], axis=0),
        ]

    def _name(self, base: str) -> str:
        """A new value name from ``base``."""
        self.count += 1
        return f"{base}/qkv{self.count}"

    def _only(self, value: str) -> bool:
        """Whether ``value`` is read once (by the next node of the chain) and is no output."""
        return self.uses.get(value, 0) == 1 and value not in self.fixed

    def _value(self, name: str) -> np.ndarray | None:
        """The value of a constant (an initializer kept as one, or a Constant node's)."""
        if name in self.constants:
            return np.asarray(self.constants[name]).reshape(-1)
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t).reshape(-1)
                if a.name == "value_ints":
                    return np.array(list(a.ints), np.int64)
        return None

    def _pieces(self, shape: str) -> list[str] | None:
        node = self.producer.get(shape)
        return list(node.input) if node is not None and node.op_type == "Concat" else None

    def _length(self, shape: str) -> int | None:
        """The number of entries of a 1-D shape value: a constant, or a Concat of constants
        and unsqueezed scalars."""
        const = self._value(shape)
        if const is not None:
            return len(const)
        pieces = self._pieces(shape)
        if pieces is None:
            return None
        total = 0
        for piece in pieces:
            const = self._value(piece)
            node = self.producer.get(piece)
            if const is not None:
                total += len(const)
            elif node is not None and node.op_type == "Unsqueeze" and self._scalar(node.input[0]):
                axes = self._value(node.input[1]) if len(node.input) > 1 else attr(node, "axes", [])
                total += len(axes) if axes is not None else 0
            else:
                return None
        return total

    def _scalar(self, name: str) -> bool:
        """Whether ``name`` is a Gather of one entry (a scalar index) of a shape."""
        node = self.producer.get(name)
        if node is None or node.op_type != "Gather":
            return False
        index = self._value(node.input[1])
        source = self.producer.get(node.input[0])
        return (
            index is not None
            and index.size == 1
            and source is not None
            and source.op_type == "Shape"
        )

    def _keeps_last(self, shape: str, n: int) -> bool:
        """Whether a Reshape to ``shape`` ends in ``n`` features."""
        const = self._value(shape)
        if const is None:
            pieces = self._pieces(shape)
            const = self._value(pieces[-1]) if pieces else None
        return const is not None and len(const) > 0 and int(const[-1]) == n


def _constant(name: str, value: np.ndarray) -> NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))


def _reads(node: NodeProto) -> list[str]:
    """The values ``node`` reads, its subgraphs' reads of outer values included."""
    names = [i for i in node.input if i]
    for sub in subgraphs(node):
        for inner in sub.node:
            names += _reads(inner)
    return names
