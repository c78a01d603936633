"""Matrix products by an initializer (MatMul, Gemm, MatMulNBits), read from their nodes: which
inputs hold the weight and along which axes its output and input features lie. The sharding
rules and the q/k/v rewrite both read products this way."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from onnx import NodeProto, helper


@dataclasses.dataclass
class Linear:
    """A matrix product by an initializer: which inputs hold it and along which axes."""

    op: str
    weight: str
    n: int  # output features
    k: int  # input features
    column: dict[str, int]  # initializer -> its axis of the output features
    row: dict[str, int]  # initializer -> its axis of whole input-feature blocks
    blocks: int = 0  # MatMulNBits: blocks of K (row-parallel splits whole blocks)


def attr(node: NodeProto, name: str, default: Any) -> Any:
    """The value of the attribute ``name`` of ``node``, else ``default``."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def linear(node: NodeProto, shapes: Mapping[str, tuple]) -> Linear | None:
    """The product ``node`` computes by an initializer (its shape in ``shapes``), or None when
    it is none of MatMul, Gemm, MatMulNBits by an initializer."""
    ins = list(node.input) + [""] * 4
    op, w = node.op_type, ins[1]
    if w not in shapes:
        return None
    shape = shapes[w]
    if op == "MatMul" and len(shape) == 2:
        return Linear(op, w, shape[1], shape[0], {w: 1}, {w: 0})
    if op == "Gemm" and len(shape) == 2:
        trans = bool(attr(node, "transB", 0))
        n_axis = 0 if trans else 1
        column = {w: n_axis}
        if len(shapes.get(ins[2], ())) == 1:  # the bias [N]
            column[ins[2]] = 0
        return Linear(op, w, shape[n_axis], shape[1 - n_axis], column, {w: 1 - n_axis})
    if op == "MatMulNBits" and len(shape) == 3:
        n, blocks = shape[0], shape[1]
        column = {w: 0}
        row = {w: 1}
        for extra in (ins[2], ins[3], ins[5]):  # scales, zero points, bias
            if extra in shapes:
                column[extra] = 0
                if len(shapes[extra]) == 2 and shapes[extra][1] == blocks and extra == ins[2]:
                    row[extra] = 1
        k = int(attr(node, "K", 0))
        return Linear(op, w, n, k, column, row, blocks)
    return None
