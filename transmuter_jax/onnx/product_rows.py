"""The fewest rows a matrix product can have, where a graph's input sizes fix it.

A graph whose inputs have static sizes but for their first (batch) axis, such as a Whisper
encoder's ``input_features [batch, 80, 3000]``, computes values whose sizes are static too.
:func:`least` runs ONNX shape inference (with data propagation, so that a Reshape to computed
sizes resolves) on a copy of such a graph without its float weights' data, and gives each value's
least row count: the product of its static sizes but the last, a symbolic axis counted as one.
Any other graph (a decoder's ``input_ids [batch, sequence]``) is not inferred: its products' rows
are not known at load.
"""

from __future__ import annotations

import math

import onnx
from onnx import ModelProto, TensorProto, shape_inference


def fixed_size(graph: onnx.GraphProto) -> bool:
    """Whether each input of ``graph`` that is not an initializer has a shape whose sizes are
    static but for the first."""
    initialized = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initialized]
    if not inputs:
        return False
    for value in inputs:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            return False
        if any(not d.HasField("dim_value") for d in list(tensor.shape.dim)[1:]):
            return False
    return True


def _light(proto: ModelProto) -> ModelProto:
    """``proto`` with its float weights of two or more axes as sizes only (no data)."""
    light = ModelProto()
    light.ir_version = proto.ir_version
    light.opset_import.extend(proto.opset_import)
    graph = light.graph
    graph.node.extend(proto.graph.node)
    graph.input.extend(proto.graph.input)
    graph.output.extend(proto.graph.output)
    for tensor in proto.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT and len(tensor.dims) >= 2:
            empty = TensorProto(name=tensor.name, data_type=tensor.data_type)
            empty.dims.extend(tensor.dims)
            graph.initializer.append(empty)
        else:
            graph.initializer.append(tensor)
    return light


def least(proto: ModelProto) -> dict[str, int]:
    """Value name -> its least number of rows (all axes but the last), for the values of a
    :func:`fixed_size` graph whose shape inference gives a rank; empty for other graphs, or where
    inference fails."""
    if not fixed_size(proto.graph):
        return {}
    try:
        inferred = shape_inference.infer_shapes(_light(proto), data_prop=True)
    except Exception:  # noqa: BLE001 - an unsupported op or opset: nothing is known
        return {}
    rows = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info]:
        tensor = value.type.tensor_type
        if not tensor.HasField("shape") or len(tensor.shape.dim) < 2:
            continue
        dims = list(tensor.shape.dim)[:-1]
        rows[value.name] = math.prod(d.dim_value if d.HasField("dim_value") else 1 for d in dims)
    return rows
